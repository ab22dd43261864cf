"""Tokens from an external OpenID Connect issuer, accepted as API tokens (docs/oidc.md).

`config.py` is what the server's settings hold (`oidc:`), and imports nothing heavy; `keys.py` reads an
issuer's signing keys (discovery, then its JWKS) over the network without holding up the event loop;
`verify.py` checks a JWT against them and maps its claims to a `TokenInfo`; `bearer.py` is the one check
every API route, `/mcp` and the request guard use (tether's own tokens, then OIDC). PyJWT is imported only
when a JWT is first checked.
"""
