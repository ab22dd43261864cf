"""`Notifier`: webhooks told what happened, off the request path, with bounded retries that survive a restart.

`emit` (called on the event loop by the hub and the task service) picks the webhooks that should hear of an
event — the server's own, and each token's whose scope reaches the event's devices and, for an approval,
whose token may answer it — renders one body per webhook and records a pending delivery in the store; the
sender task then sends it, signed, with a timeout, and records the outcome. A failed send (a network error,
HTTP 5xx, 408 or 429) is retried after `webhook_retry_s` * 2^(attempt-1) seconds (capped at an hour) until
`webhook_attempts` tries; any other answer fails it at once. Nothing is lost in a restart: pending
deliveries are rows, and a delivery claimed by a sender that died is taken again when its claim runs out.

`changes` is the inbox's live signal: bumped whenever something may have been asked or answered, so the
dashboard's badge is pushed rather than polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tether.server.notify.messages import TEST_EVENT, render
from tether.server.notify.pinning import pinned_client
from tether.server.notify.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from tether.server.notify.urls import WebhookRefused, redact, resolve_webhook
from tether.server.store import Store, StoreUnavailable
from tether.server.store.webhooks import DELIVERED, FAILED, PENDING
from tether.version import __version__

if TYPE_CHECKING:

    from tether.server.settings import ServerSettings

logger = logging.getLogger("tether.server.notify")
BATCH = 32  # deliveries sent at once
MAX_BACKOFF_S = 3600.0
IDLE_WAKE_S = 30.0  # the sender looks for due deliveries at least this often (another server's, a lost wake)
RETRIED_STATUSES = frozenset({408, 425, 429})


class Changes:
    """A counter that only grows, and a way to wait until it moves past a value (the inbox's live signal)."""

    def __init__(self) -> None:
        self.version = 0
        self.closed = False  # the server is stopping: followers end
        self._moved = asyncio.Event()

    def close(self) -> None:
        """The server is stopping: wake every waiter for good."""
        self.closed = True
        self.bump()

    def bump(self) -> None:
        """Something may have been asked or answered: wake every waiter."""
        self.version += 1
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    async def wait(self, seen: int, timeout: float) -> int:
        """The version once it is past `seen`, or after `timeout` seconds, whichever comes first."""
        if self.version == seen:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._moved.wait(), timeout)
        return self.version


class Notifier:
    """The server's webhooks and their deliveries (see the module docstring). Started and closed with the
    app; `emit` before `start` records deliveries that are sent once it starts."""

    def __init__(self, store: Store, settings: ServerSettings, base_url: str | None = None) -> None:
        self.store = store
        self.settings = settings
        self.base_url = base_url
        self.changes = Changes()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Write the configured webhooks into the store and start sending (what a restart left pending too)."""
        await self.store.call(self.store.webhooks.replace_config, [
            (hook.id, hook.url, hook.secret, list(hook.events), hook.format) for hook in self.settings.webhooks])
        self._sender = asyncio.create_task(self._send_forever(), name="tether-webhooks")

    async def aclose(self) -> None:
        """Stop sending; a delivery under way is sent again after a restart (its claim runs out)."""
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender

    # -- who hears of what ---------------------------------------------------------------------------

    def emit(self, event: str, text: str, fields: dict[str, Any], *, data: dict[str, Any] | None = None,
             devices: Iterable[tuple[str, Iterable[str]]] = (), answer_scope: str | None = None,
             asker: str | None = None, link: str | None = None, only: str | None = None) -> int | None:
        """Record a delivery of `event` to every webhook that should hear of it; how many. `devices` are the
        (name, tags) it concerns: a token's webhook hears of it only when the token reaches them all.
        `answer_scope` (for an approval) is the scope answering it takes ("approve": a person's token only;
        "execute": `asker`'s own question); `only` sends it to that one webhook (a test). Never raises: a store
        that cannot write is logged. With PostgreSQL, on an event loop, they are recorded behind the caller
        (`Store.soon`: the loop never waits for the database) and it returns None."""
        self.changes.bump()
        args = (event, text, fields, data or {}, list(devices), answer_scope, asker, link, only)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self.store.calls is None:
            made = self._recorded(*args)
            if made:
                self._wake.set()
            return made

        def behind() -> None:
            if self._recorded(*args):
                with contextlib.suppress(RuntimeError):  # the loop has closed: sent after a restart
                    loop.call_soon_threadsafe(self._wake.set)

        self.store.soon(behind)
        return None

    async def emitted(self, event: str, text: str, fields: dict[str, Any], *, data: dict[str, Any] | None = None,
                      only: str | None = None) -> int:
        """`emit` awaited: how many deliveries were recorded (the event loop goes on meanwhile)."""
        self.changes.bump()
        made = await self.store.call(self._recorded, event, text, fields, data or {}, [], None, None, None, only)
        if made:
            self._wake.set()
        return made

    def _recorded(self, *args: Any) -> int:
        """`_record`, its errors logged (0)."""
        event = args[0]
        try:
            return self._record(*args)
        except (StoreUnavailable, OSError) as exc:
            logger.error("webhook deliveries of %s not recorded: %s", event, exc)
            return 0
        except Exception:  # a notification must never break the action it reports
            logger.exception("webhook deliveries of %s not recorded", event)
            return 0

    def _record(self, event: str, text: str, fields: dict[str, Any], data: dict[str, Any],
                devices: list[tuple[str, Iterable[str]]], answer_scope: str | None, asker: str | None,
                link: str | None, only: str | None) -> int:
        def wanted(row: Any) -> bool:
            if only is not None:
                return bool(row["id"] == only)
            return event != TEST_EVENT and event in json.loads(row["events"])

        hooks = [row for row in self.store.webhooks.listed() if wanted(row)]
        if not hooks:
            return 0
        tokens = {info.id: info for info in self.store.tokens.all()} if any(r["owner"] for r in hooks) else {}
        now, made = time.time(), 0
        for row in hooks:
            owner = row["owner"]
            if owner is not None:
                info = tokens.get(owner)
                if info is None or not info.active or info.kind != "api":
                    continue
                if not all(info.reaches(name, list(tags)) for name, tags in devices):
                    continue
                if answer_scope == "approve" and (info.agent or not info.allows("approve")):
                    continue
                if answer_scope == "execute" and info.name != asker and not info.allows("admin"):
                    continue
            delivery = "dlv_" + secrets.token_hex(8)
            body = render(row["format"], event, delivery, text, fields, data, link)
            self.store.webhooks.enqueue(delivery, row["id"], event, body, now)
            made += 1
        return made

    # -- sending -------------------------------------------------------------------------------------

    async def _send_forever(self) -> None:
        while True:
            self._wake.clear()
            try:
                due = await self.store.call(self.store.webhooks.due, time.time(), BATCH)
                if due:
                    await asyncio.gather(*(self._claim_and_send(row) for row in due))
                    continue
                upcoming = await self.store.call(self.store.webhooks.next_due)
            except (StoreUnavailable, OSError) as exc:
                logger.error("webhook deliveries not read: %s", exc)
                upcoming = None
            pause = IDLE_WAKE_S if upcoming is None else min(max(upcoming - time.time(), 0.0), IDLE_WAKE_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), pause)

    async def _claim_and_send(self, row: Any) -> None:
        lease = time.time() + 2 * self.settings.webhook_timeout + 10.0  # a dead sender's claim runs out
        try:
            if not await self.store.call(self.store.webhooks.claim, row["id"], row["next_at"], lease):
                return
            await self._send(row)
        except (StoreUnavailable, OSError) as exc:
            logger.error("webhook delivery %s not recorded: %s", row["id"], exc)
        except Exception:
            logger.exception("webhook delivery %s failed unexpectedly", row["id"])

    async def _send(self, row: Any) -> None:
        hook = await self.store.call(self.store.webhooks.get, row["webhook_id"])
        secret = await self.store.call(self.store.webhooks.secret, row["webhook_id"])
        if hook is None or secret is None or self._sender is None:
            return  # removed since: its deliveries went with it
        url, attempts = str(hook["url"]), int(row["attempts"]) + 1
        status: int | None = None
        try:
            # resolved and checked once; the connection goes to that address (no second lookup to rebind)
            address = await resolve_webhook(url, self.settings.webhook_allow_private)
            body = str(row["body"]).encode()
            stamp = str(int(time.time()))
            async with pinned_client(url, address, self.settings.webhook_timeout) as client:
                answer = await client.post(url, content=body, headers={
                    "Content-Type": "application/json", "User-Agent": f"tether/{__version__}",
                    "X-Tether-Event": str(row["event"]), "X-Tether-Delivery": str(row["id"]),
                    TIMESTAMP_HEADER: stamp, SIGNATURE_HEADER: sign(secret, stamp, body)})
            status = answer.status_code
            if 200 <= status < 300:
                await self.store.call(self.store.webhooks.settle, row["id"], DELIVERED, attempts, time.time(), status,
                                      None)
                return
            error = f"HTTP {status}"
            retry = status >= 500 or status in RETRIED_STATUSES
        except WebhookRefused as exc:
            error, retry = str(exc), False
        except Exception as exc:  # httpx's errors (timeouts, refused connections, TLS): the URL never shown
            error, retry = f"{type(exc).__name__}: {str(exc).replace(url, redact(url))}"[:500], True
        if retry and attempts < self.settings.webhook_attempts:
            delay = min(self.settings.webhook_retry_s * 2 ** (attempts - 1), MAX_BACKOFF_S)
            await self.store.call(self.store.webhooks.settle, row["id"], PENDING, attempts, time.time() + delay, status,
                                  error)
            self._wake.set()
        else:
            await self.store.call(self.store.webhooks.settle, row["id"], FAILED, attempts, time.time(), status, error)
            logger.warning("webhook %s (%s): delivery %s of %s failed after %d attempt(s): %s", hook["id"],
                           redact(url), row["id"], row["event"], attempts, error)
