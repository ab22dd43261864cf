"""Who is who, and who may do what: `device_keys` (which Ed25519 key each device is), `pairing` (devices
that enrol without a token, let in by an admin), `oidc/` (tokens from an external OpenID Connect issuer,
accepted as API tokens), `approvals` (who may approve: a person, never an agent; four-eyes) and `sessions`
(who may write into which undo session). A token's device scope is `tether.server.aip.fleet.scopes`.

Importing this package imports nothing else; import the module you need.
"""
