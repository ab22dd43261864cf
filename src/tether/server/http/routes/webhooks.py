"""Webhooks over REST (docs/approvals.md): `GET/POST /api/v1/webhooks`, `DELETE /api/v1/webhooks/{id}`,
`GET /api/v1/webhooks/{id}/deliveries` and `POST /api/v1/webhooks/{id}/test`.

A webhook belongs to the API token that added it and hears of what that token may see (its devices; an
approval only when the token may answer it); a server-wide one (`server_wide`) hears of everything and takes
an `admin` token that reaches every device, as do the ones in the server's config file (listed, not removable
here). The secret is in the answer that creates a webhook and nowhere else; URLs are listed redacted.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.server.http.api import ERROR_RESPONSES, require
from tether.server.notify.messages import EVENTS, TEST_EVENT
from tether.server.notify.notifier import Notifier
from tether.server.notify.signing import new_secret
from tether.server.notify.urls import WebhookRefused, check_webhook_url, redact
from tether.server.store.tokens import TokenInfo
from tether.server.trust.oidc.verify import is_oidc

URL_SHAPE = r"^https?://[A-Za-z0-9-]{1,63}(\.[A-Za-z0-9-]{1,63})*(:[1-5]?[0-9]{1,4})?(/[!-~]*)?$"  # [IPv6] too
webhook_router = APIRouter(prefix="/api/v1/webhooks", responses=ERROR_RESPONSES, tags=["webhooks"])
MAX_PER_TOKEN = 20


class WebhookRequest(BaseModel):
    """A webhook to add."""

    model_config = ConfigDict(extra="forbid")

    # the pattern documents the rule; the route checks it (and the address) itself, saying what is wrong in words
    url: str = Field(max_length=2048, description="http:// or https:// URL the deliveries are POSTed to",
                     json_schema_extra={"pattern": URL_SHAPE})
    events: list[Literal[EVENTS]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(EVENTS), min_length=1, max_length=len(EVENTS),
        description=f"some of {', '.join(EVENTS)} (default all)")
    format: Literal["slack", "generic"] = Field(
        "generic", description="'slack' (Slack incoming webhooks: text and blocks) or 'generic'")
    server_wide: bool = Field(False, description="the server's (every event; admin) rather than this token's")
    secret: str | None = Field(None, min_length=16, max_length=256,
                               description="the signing secret (default: a new random one, in the answer)")


def _notifier(request: Request) -> Notifier:
    return request.app.state.notifier


def _fleet_admin(who: TokenInfo) -> bool:
    return who.allows("admin") and not who.scoped and not who.agent


def _view(row: Any, owners: dict[str, str]) -> dict[str, Any]:
    owner = row["owner"]
    return {"id": row["id"], "url": redact(row["url"]), "events": json.loads(row["events"]), "format": row["format"],
            "server_wide": owner is None, "owner": owners.get(owner, owner) if owner else None,
            "source": row["source"], "created_at": row["created_at"]}


async def _mine(request: Request, webhook_id: str, who: TokenInfo) -> Any:
    store = _notifier(request).store
    row = await store.call(store.webhooks.get, webhook_id)
    if row is None or not (row["owner"] == who.id or _fleet_admin(who)):
        raise HTTPException(404, f"no webhook '{webhook_id}' of token '{who.name}' (`tether webhooks` lists them)")
    return row


@webhook_router.get("")
async def list_webhooks(request: Request, who: Annotated[TokenInfo, Depends(require("read"))]) -> list[dict[str, Any]]:
    """The caller's webhooks; for an admin reaching every device, every webhook. Secrets are never listed."""
    store = _notifier(request).store
    owners = {t.id: t.name for t in await store.call(store.tokens.all)}
    return [_view(row, owners) for row in await store.call(store.webhooks.listed)
            if row["owner"] == who.id or _fleet_admin(who)]


@webhook_router.post("", status_code=201)
async def add_webhook(body: WebhookRequest, request: Request,
                      who: Annotated[TokenInfo, Depends(require("read"))]) -> dict[str, Any]:
    """Add a webhook; the answer holds its signing secret, shown this once. 400 for a URL that is not an http or
    https one; 403 for one whose host resolves to a private, loopback or link-local address (refused unless the
    server's `webhook_allow_private`); 404 for a host that does not resolve."""
    notifier = _notifier(request)
    if body.server_wide and not _fleet_admin(who):
        raise HTTPException(403, f"token '{who.name}' may not add a server-wide webhook: that takes a person's "
                                 "admin token reaching every device; leave out server_wide for this token's own")
    if not body.server_wide and is_oidc(who):  # its deliveries are checked against the tokens table (notifier)
        raise HTTPException(403, f"'{who.name}' is an OpenID Connect identity, which cannot own a webhook (its "
                                 "tokens expire); use a tether API token, or add it server_wide with an admin's")
    try:
        await check_webhook_url(body.url, notifier.settings.webhook_allow_private)
    except WebhookRefused as exc:
        raise HTTPException(exc.status, str(exc)) from None
    store = notifier.store
    if not body.server_wide and sum(r["owner"] == who.id for r in await store.call(store.webhooks.listed)
                                    ) >= MAX_PER_TOKEN:
        raise HTTPException(409, f"token '{who.name}' has {MAX_PER_TOKEN} webhooks already; remove one first")
    webhook_id, secret = "wh_" + secrets.token_hex(6), body.secret or new_secret()
    events = list(dict.fromkeys(body.events))
    await store.call(store.webhooks.add, webhook_id, body.url.strip(), secret, events, body.format,
                     None if body.server_wide else who.id, "api")
    row = await store.call(store.webhooks.get, webhook_id)
    return {**_view(row, {who.id: who.name}), "secret": secret}


@webhook_router.delete("/{webhook_id}")
async def remove_webhook(webhook_id: str, request: Request,
                         who: Annotated[TokenInfo, Depends(require("read"))]) -> dict[str, Any]:
    """Remove one of the caller's webhooks (an admin reaching every device: any), with its deliveries."""
    row = await _mine(request, webhook_id, who)
    if row["source"] == "config":
        raise HTTPException(409, f"webhook '{webhook_id}' is in the server's config file (webhooks:); remove it "
                                 "there and restart the server")
    store = _notifier(request).store
    await store.call(store.webhooks.remove, webhook_id)
    return {"removed": webhook_id}


@webhook_router.get("/{webhook_id}/deliveries")
async def webhook_deliveries(webhook_id: str, request: Request, who: Annotated[TokenInfo, Depends(require("read"))],
                             limit: Annotated[int, Query(ge=1, description="at most 500")] = 50
                             ) -> list[dict[str, Any]]:
    """The webhook's latest deliveries, newest first: event, status (pending, delivered, failed), attempts,
    the last HTTP status and error, when the next try is due."""
    await _mine(request, webhook_id, who)
    store = _notifier(request).store
    rows = await store.call(store.webhooks.deliveries, webhook_id, max(1, min(limit, 500)))
    return [{k: row[k] for k in row.keys()} for row in rows]  # noqa: SIM118 - a Row iterates its values


@webhook_router.post("/{webhook_id}/test", status_code=202)
async def test_webhook(webhook_id: str, request: Request,
                       who: Annotated[TokenInfo, Depends(require("read"))]) -> dict[str, Any]:
    """Send a `ping` delivery to this webhook (recorded like any other)."""
    await _mine(request, webhook_id, who)
    made = await _notifier(request).emitted(TEST_EVENT, f"tether webhook {webhook_id} works",
                                            {"Webhook": webhook_id, "Added by": who.name},
                                            data={"webhook": webhook_id}, only=webhook_id)
    return {"queued": made}
