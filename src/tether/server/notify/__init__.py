"""Notifications that reach a person: webhooks (a token's, or the server's) told when an approval is needed,
a task finishes or fails, or a device goes offline; and the live signal the approval inbox follows.

`urls` checks where a webhook may point (http/https; no private, loopback or link-local address unless the
server's `webhook_allow_private` says so) and redacts URLs for listings and logs; `signing` signs each body
(HMAC-SHA256 over the timestamp and the body) and verifies it, as a receiver does; `messages` writes the
bodies (Slack-compatible or generic JSON); `notifier.Notifier` records each delivery in the store and sends it
off the request path with bounded retries. See docs/approvals.md.
"""
