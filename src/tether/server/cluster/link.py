"""Direct links between the nodes of a cluster: the bus's messages over one WebSocket per pair of nodes.

Over Redis a request costs four stream operations (the asker's XADD, the holder's XREAD, and the same
back) and Redis's own CPU; over a link it is one frame each way. A link is an optimisation only: the
bus sends over Redis whenever no link to that node is open (not dialled yet, refused, dropped), so a
node without links — or with links turned off (`cluster_link = "off"`) — works exactly as before.

- **Addresses.** Each node announces its link URL with its node entry in Redis (`link`): the setting
  `cluster_link` (a ws:// or wss:// URL of this node), else one made from the bind address and port
  (for a wildcard bind: the address this host reaches Redis from).
- **Authentication.** A cluster secret kept in Redis (`tether:link-secret`, made by the first node that
  needs it): whoever can read it can already write every node's inbox, so the link adds no new party to
  trust. The dialling node sends `X-Tether-Node` (its name), `X-Tether-Time` and an HMAC-SHA256 of
  both and the target's name under that secret; the secret itself never crosses a link. A wrong or old
  proof is refused (403) before the upgrade.
- **Frames.** Each text frame is a JSON list of bus messages: what a node sends to the same peer within
  one loop turn goes as one frame (batching under load, no wait when idle). A frame is kept under
  `max_frame` bytes of UTF-8 (the WebSocket frame limit the nodes' servers take); a message that alone is
  over it goes through Redis (`elsewhere`).
- **Faults.** A link that drops is told to the bus (`on_lost`), which sends the requests still waiting
  on an answer over it again through Redis (see `Bus._link_lost`). A dialled link pings; one that stops
  answering is closed. After a failed dial the node waits `REDIAL_S` before trying that peer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pydantic_core import from_json, to_json

from tether.server.http.request_guard import WILDCARDS, deny_websocket

if TYPE_CHECKING:
    from starlette.websockets import WebSocket

log = logging.getLogger("tether.cluster")

LINK_PATH = "/cluster/link"
MAX_SKEW_S = 120.0  # a proof older (or newer) than this is refused: the nodes' clocks are kept in sync anyway
REDIAL_S = 5.0  # after a failed dial, the bus uses Redis for that peer this long before the next try
PING_S = 5.0  # a dialled link pings this often and is closed when a ping goes unanswered as long
MAX_FRAME_BYTES = 64 * 1024 * 1024

Dispatch = Callable[[dict[str, Any]], None]
Lookup = Callable[[str], Awaitable[str | None]]


def proof(secret: str, origin: str, target: str, at: str) -> str:
    """The HMAC a node dialling `target` as `origin` at unix time `at` sends: hex SHA-256 under `secret`."""
    return hmac.new(secret.encode(), f"{origin}\n{target}\n{at}".encode(), hashlib.sha256).hexdigest()


def default_url(host: str, port: int, tls: bool, redis_url: str) -> str:
    """This node's link URL when none is set: its bind address, or for a wildcard bind (0.0.0.0, ::) the
    local address of this host's route to Redis, which the other nodes reach Redis through too."""
    scheme = "wss" if tls else "ws"
    bind = host.strip().strip("[]")
    if bind in WILDCARDS:
        bind = "127.0.0.1"
        target = urlsplit(redis_url)
        if target.hostname and target.scheme in ("redis", "rediss"):
            with contextlib.suppress(OSError):
                family = socket.AF_INET6 if ":" in target.hostname else socket.AF_INET
                with socket.socket(family, socket.SOCK_DGRAM) as probe:  # no packet is sent
                    probe.connect((target.hostname, target.port or 6379))
                    bind = str(probe.getsockname()[0])
    shown = f"[{bind}]" if ":" in bind else bind
    return f"{scheme}://{shown}:{port}{LINK_PATH}"


def api_url(link_url: str) -> str:
    """The API base URL (http(s)://host:port) of the node whose link URL is `link_url`."""
    parts = urlsplit(link_url)
    return f"{'https' if parts.scheme == 'wss' else 'http'}://{parts.netloc}"


def encode_frame(messages: list[dict[str, Any]]) -> bytes:
    """A frame's JSON (UTF-8): pydantic-core's encoder, which writes what `json.dumps` does compactly in less
    CPU; a string it cannot write (a lone surrogate, as in a device's odd output) is escaped as `json.dumps`
    does."""
    try:
        return to_json(messages)
    except ValueError:
        return json.dumps(messages, separators=(",", ":")).encode()


def decode_frame(frame: str | bytes) -> Any:
    """A frame's messages (`encode_frame`'s inverse); ValueError for a frame that is not JSON."""
    try:
        return from_json(frame)
    except ValueError:  # pydantic-core refuses an escaped lone surrogate, which JSON allows
        return json.loads(frame)


class Link:
    """One open connection to `peer` (dialled or accepted). `send` writes a message at once when no frame is
    being written, else it joins the messages waiting behind that frame, which go as one frame next (of at
    most `max_frame` bytes; a message over that alone is handed to `elsewhere`). A failed write
    closes the link (`failed(link, error, the messages of that write)`)."""

    def __init__(self, peer: str, send_text: Callable[[str], Awaitable[None]], max_frame: int,
                 elsewhere: Callable[[str, dict[str, Any]], None],
                 failed: Callable[[Link, BaseException, list[dict[str, Any]]], None]) -> None:
        self.peer = peer
        self.open = True
        self.max_frame = max_frame
        self.elsewhere = elsewhere
        self.failed = failed
        self._send_text = send_text
        self._queue: list[dict[str, Any]] = []
        self._writing = False
        self._flusher: asyncio.Task[None] | None = None

    async def send(self, message: dict[str, Any]) -> None:
        """Send `message` (see the class); returns once it is written or queued behind a write under way."""
        self._queue.append(message)
        if self._writing:
            return
        self._writing = True
        try:
            batch: list[dict[str, Any]] = []
            while self._queue and self.open:
                batch, self._queue = self._queue, []
                await self._write(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failed(self, exc, batch)
        finally:
            self._writing = False
            if self._queue and self.open:  # cancelled with messages behind its frame: a task writes them
                self._flusher = asyncio.create_task(self.send_queued(), name=f"cluster-link-{self.peer}")

    async def send_queued(self) -> None:
        """Write what waits in the queue (after a sender was cancelled mid-write)."""
        if self._queue and not self._writing:
            await self.send(self._queue.pop())  # it joins the queue again, last as it was

    def close(self) -> list[dict[str, Any]]:
        """Mark the link closed; returns the messages still queued (never written)."""
        self.open = False
        unsent, self._queue = self._queue, []
        if self._flusher is not None:
            self._flusher.cancel()
        return unsent

    async def _write(self, batch: list[dict[str, Any]]) -> None:
        data = encode_frame(batch)
        if len(data) <= self.max_frame:
            await self._send_text(data.decode())
            return
        for message in batch:  # too large together: one by one, and through Redis what is too large alone
            data = encode_frame([message])
            if len(data) <= self.max_frame:
                await self._send_text(data.decode())
            else:
                self.elsewhere(self.peer, message)


class Links:
    """This node's links. `dispatch(message)` takes each message a link brings; `on_lost(peer, link)` is
    told of a link that closed; `lookup(peer)` answers a peer's link URL (from its node entry);
    `read_secret()` the cluster secret (made if missing); `elsewhere(peer, message)` sends a message another
    way (one over `max_frame`, or one a closed link may not have carried)."""

    def __init__(self, node: str, dispatch: Dispatch, on_lost: Callable[[str, Link], None], lookup: Lookup,
                 read_secret: Callable[[], Awaitable[str]], *, max_frame: int,
                 elsewhere: Callable[[str, dict[str, Any]], None]) -> None:
        self.node = node
        self.max_frame = max_frame
        self.elsewhere = elsewhere
        self.dispatch = dispatch
        self.on_lost = on_lost
        self.lookup = lookup
        self.read_secret = read_secret
        self.secret: str | None = None
        self._links: dict[str, Link] = {}
        self._dialing: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, float] = {}  # peer -> loop time of its last failed dial
        self._closing = False

    def get(self, peer: str) -> Link | None:
        """The open link to `peer`, or None (then a dial starts in the background unless one failed lately,
        and the caller uses Redis this time)."""
        link = self._links.get(peer)
        if link is not None:
            return link
        if not self._closing and peer not in self._dialing and peer != self.node:
            failed = self._failed.get(peer)
            if failed is None or asyncio.get_running_loop().time() - failed >= REDIAL_S:
                self._dialing[peer] = asyncio.create_task(self._dial(peer), name=f"cluster-dial-{peer}")
        return None

    def drop(self, peer: str) -> None:
        """Forget the link to `peer` (its node is gone); its connection is closed by its own loop."""
        link = self._links.pop(peer, None)
        if link is not None:
            self._lost(link)

    async def aclose(self) -> None:
        """Close every link and stop dialling (the node stops)."""
        self._closing = True
        tasks = list(self._dialing.values())
        for task in tasks:
            task.cancel()
        for link in list(self._links.values()):
            link.close()
        self._links.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    # -- dialling ----------------------------------------------------------------------------------

    async def _dial(self, peer: str) -> None:
        import websockets

        loop = asyncio.get_running_loop()
        try:
            url = await self.lookup(peer)
            if url is None:
                raise LookupError(f"node {peer} announced no link")
            if self.secret is None:
                self.secret = await self.read_secret()
            at = str(int(time.time()))
            headers = {"X-Tether-Node": self.node, "X-Tether-Time": at,
                       "Authorization": f"Link {proof(self.secret, self.node, peer, at)}"}
            async with asyncio.timeout(REDIAL_S):
                connection = await websockets.connect(url, additional_headers=headers, max_size=MAX_FRAME_BYTES,
                                                      ping_interval=PING_S, ping_timeout=PING_S, compression=None,
                                                      open_timeout=REDIAL_S)
        except asyncio.CancelledError:
            self._dialing.pop(peer, None)
            raise
        except Exception as exc:
            self._failed[peer] = loop.time()
            self._dialing.pop(peer, None)
            log.info("cluster link to node %s not open (%s): its messages go through Redis", peer, exc)
            return
        self._failed.pop(peer, None)
        self._dialing.pop(peer, None)
        log.info("cluster link to node %s open (%s)", peer, url)
        link = self._register(peer, connection.send)
        try:
            async for frame in connection:
                self._take(peer, frame)
        except Exception as exc:
            log.info("cluster link to node %s dropped (%s)", peer, exc)
        finally:
            self._close(link)
            with contextlib.suppress(Exception):
                await connection.close()

    # -- accepting ---------------------------------------------------------------------------------

    async def accept(self, websocket: WebSocket) -> None:
        """The `LINK_PATH` endpoint: check the dialling node's proof, then run the link until it closes."""
        peer = websocket.headers.get("x-tether-node", "")
        refusal = await self._refusal(peer, websocket.headers.get("x-tether-time", ""),
                                      websocket.headers.get("authorization", ""))
        if refusal is not None:
            log.warning("cluster link from %s refused: %s", websocket.client, refusal)
            await deny_websocket(websocket.scope, websocket.send, 403, refusal)
            return
        await websocket.accept()
        link = self._register(peer, websocket.send_text)
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    break
                self._take(peer, message.get("text") or message.get("bytes") or b"")
        except Exception as exc:
            log.info("cluster link from node %s dropped (%s)", peer, exc)
        finally:
            self._close(link)

    async def _refusal(self, peer: str, at: str, authorization: str) -> str | None:
        if self._closing:
            return "this node is stopping"
        if not peer or peer == self.node or not at.isdigit() or not authorization.startswith("Link "):
            return "not a cluster node's link request"
        if abs(time.time() - int(at)) > MAX_SKEW_S:
            return f"the link request's time is more than {MAX_SKEW_S:g} s off"
        given = authorization[5:].strip()
        for fresh in (False, True):  # the secret may have been made anew (Redis restarted empty): read once more
            if self.secret is None or fresh:
                try:
                    self.secret = await self.read_secret()
                except Exception as exc:
                    return f"the cluster secret cannot be read ({exc})"
            if hmac.compare_digest(given, proof(self.secret, peer, self.node, at)):
                return None
        return "wrong proof of the cluster secret"

    # -- both --------------------------------------------------------------------------------------

    def _register(self, peer: str, send_text: Callable[[str], Awaitable[None]]) -> Link:
        link = Link(peer, send_text, self.max_frame, self.elsewhere, self._write_failed)
        self._links[peer] = link  # the newest connection carries what is sent from now on
        return link

    def _write_failed(self, link: Link, exc: BaseException, batch: list[dict[str, Any]]) -> None:
        log.info("cluster link to node %s: a send failed (%s)", link.peer, exc)
        self._close(link)
        self._reroute(link.peer, batch)

    def _reroute(self, peer: str, messages: list[dict[str, Any]]) -> None:
        """Messages a closed link may not have carried go another way (`elsewhere`: through Redis). Requests
        are left out: the bus sends each again itself, or answers it, as it sees the link lost; an answer
        or a cancel that arrives twice is taken once."""
        for message in messages:
            if message.get("t") != "req":
                self.elsewhere(peer, message)

    def _take(self, peer: str, frame: str | bytes) -> None:
        try:
            messages = decode_frame(frame)
        except ValueError as exc:
            log.warning("cluster link from node %s: unreadable frame dropped (%s)", peer, exc)
            return
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, dict):
                self.dispatch(message)

    def _close(self, link: Link) -> None:
        if self._links.get(link.peer) is link:
            del self._links[link.peer]
        self._lost(link)

    def _lost(self, link: Link) -> None:
        if not link.open:
            return
        self._reroute(link.peer, link.close())
        try:
            self.on_lost(link.peer, link)
        except Exception:
            log.exception("handling the loss of the cluster link to node %s failed", link.peer)


def new_secret() -> str:
    """A fresh cluster secret (256 bits, hex)."""
    return secrets.token_hex(32)
