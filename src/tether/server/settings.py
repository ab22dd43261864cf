"""`ServerSettings`: where the agent server listens, how it judges liveness, and where it keeps state.

Defaults are the safe ones: loopback only, an 8 MiB frame limit, heartbeats every 5 s with a
15 s timeout (three missed beats before a device counts as gone) and a 10 s grace period in which
a dropped device may reconnect and still deliver the results of the batch it was running. HTTP
request bodies are capped (`max_body_bytes` once the API token is known, `ANONYMOUS_BODY_BYTES`
before), and requests must name this server in `Host` (and `Origin`, when a browser sends one):
the localhost names, the bind address and `allowed_hosts` (see `tether.server.http.request_guard`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import socket
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tether.addresses import is_loopback
from tether.server.notify.messages import EVENTS as WEBHOOK_EVENTS
from tether.server.trust.oidc.config import OidcIssuer, issuer_list

DEFAULT_MAX_FRAME_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
ANONYMOUS_BODY_BYTES = 64 * 1024  # the body cap before (or without) a valid API token
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024  # the largest batch of results one REST answer carries


def default_state_dir() -> Path:
    """$TETHER_STATE_DIR or $XDG_STATE_HOME/tether (~/.local/state/tether).

    The same rule as the device's `tether.tools.context.default_state_dir`, repeated here because
    the server must not import the tools layer (DESIGN.md: protocol ← server).
    """
    env = os.environ.get("TETHER_STATE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tether"


def normalize_host(value: str) -> str | None:
    """The host part of a `Host` value or an allowed-host entry, lower case, without port, brackets
    or a trailing dot; None when it is not a plausible host at all."""
    value = value.strip().lower()
    if not value:
        return None
    if value.startswith("["):  # [v6] or [v6]:port
        end = value.find("]")
        if end < 0 or (value[end + 1:] and not _is_port(value[end + 1:])):
            return None
        return value[1:end] or None
    if value.count(":") == 1:  # name:port or v4:port
        value, _, port = value.partition(":")
        if not port.isdigit():
            return None
    elif value.count(":") > 1:  # a bare IPv6 address (allowed-host entries may be written so)
        return value if is_ip(value) else None
    value = value.rstrip(".")
    if not value or any(c.isspace() or c in "/\\@?#%" for c in value):
        return None
    return value


DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
Origin = tuple[str, str, int]  # (scheme, host, port), the scheme http or https, the port explicit


def parse_origin(text: str) -> Origin | None:
    """A browser `Origin` (or an `allowed_origins` entry) as (scheme, host, port): lower case, default
    ports filled in (http 80, https 443; ws and wss count as http and https); None when it is not one
    (`null`, another scheme, a path, user info, a bad port)."""
    text = text.strip()
    if "://" not in text:
        return None
    scheme, _, rest = text.partition("://")
    scheme = scheme.lower()
    if scheme not in DEFAULT_PORTS:
        return None
    rest = rest[:-1] if rest.endswith("/") else rest
    if not rest or any(c in rest for c in "/?#@\\") or any(c.isspace() for c in rest):
        return None
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            return None
        host, port_text = rest[1:end], rest[end + 1:]
        if port_text and not _is_port(port_text):
            return None
        port_text = port_text[1:]
    else:
        host, sep, port_text = rest.rpartition(":") if rest.count(":") == 1 else (rest, "", "")
        if sep and not port_text.isdigit():
            return None
    host = host.lower().rstrip(".")
    if not host:
        return None
    port = int(port_text) if port_text else DEFAULT_PORTS[scheme]
    if not 0 < port <= 65535:
        return None
    return ("https" if scheme in ("https", "wss") else "http", host, port)


def format_origin(origin: Origin) -> str:
    """`origin` as text, the default port left out."""
    scheme, host, port = origin
    shown = f"[{host}]" if ":" in host else host
    return f"{scheme}://{shown}" if port == DEFAULT_PORTS[scheme] else f"{scheme}://{shown}:{port}"


def _is_port(text: str) -> bool:
    return text.startswith(":") and text[1:].isdigit()


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


class WebhookConfig(BaseModel):
    """A webhook of the whole server (the config file's `webhooks:` list): told of every event it names."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="where deliveries are POSTed (http:// or https://)")
    secret: str = Field(min_length=16, description="the HMAC-SHA256 signing secret (docs/approvals.md)")
    events: list[str] = Field(default_factory=lambda: list(WEBHOOK_EVENTS), description=(
        "the events it is told of: approval.needed, task.finished, task.failed, device.offline (default: all)"))
    format: str = Field("generic", description="'slack' (text and blocks) or 'generic' JSON")

    @field_validator("url")
    @classmethod
    def _url(cls, url: str) -> str:
        from tether.server.notify.urls import parse_webhook_url

        parse_webhook_url(url)  # WebhookRefused is a ValueError: pydantic says which entry
        return url.strip()

    @field_validator("events")
    @classmethod
    def _events(cls, events: list[str]) -> list[str]:
        unknown = sorted(set(events) - set(WEBHOOK_EVENTS))
        if unknown or not events:
            raise ValueError(f"events must be some of {', '.join(WEBHOOK_EVENTS)}"
                             + (f", not {', '.join(unknown)}" if unknown else ""))
        return list(dict.fromkeys(events))

    @field_validator("format")
    @classmethod
    def _format(cls, fmt: str) -> str:
        if fmt not in ("slack", "generic"):
            raise ValueError("format must be 'slack' or 'generic'")
        return fmt

    @property
    def id(self) -> str:
        """A stable id for this entry (its URL's digest), so its deliveries survive a restart."""
        return "wh_cfg_" + hashlib.sha256(self.url.encode()).hexdigest()[:12]


class ServerSettings(BaseModel):
    """Everything the agent server needs to start; validated so a bad value fails at start-up."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8765, ge=0, le=65535)
    db_path: Path = Field(default_factory=lambda: default_state_dir() / "server.db")
    db_url: str | None = Field(None, description=(
        "a postgresql:// URL: the server's state in PostgreSQL instead of db_path (several servers share it)"))
    cluster_url: str | None = Field(None, description=(
        "a redis:// (or rediss://) URL: this server is one node of a cluster sharing that Redis and one database "
        "(db_url); devices connected to any node take commands from every node"))
    cluster_link: str | None = Field(None, description=(
        "how the other nodes reach this one for direct links (a ws:// or wss:// URL ending in /cluster/link; "
        "default: the bind address and port), or 'off' to send everything between nodes through Redis"))
    node_id: str | None = Field(None, max_length=128, description=(
        "this node's name in the cluster and in task leases (default: the host name and a digest of the state "
        "directory and database, stable across restarts)"))
    heartbeat_interval: float = Field(5.0, gt=0, description="how often a device sends a heartbeat")
    heartbeat_timeout: float = Field(15.0, gt=0, description="silence after which a device is offline")
    grace_period: float = Field(10.0, ge=0, description="how long a dropped device's batches wait for it")
    register_timeout: float = Field(10.0, gt=0, description="how long a new socket may take to register")
    max_admitting: int = Field(256, ge=1, description=(
        "device sockets that may be registering at once; more are refused with HTTP 503 and Retry-After "
        "(a reconnect storm is admitted at the pace the server registers)"))
    listen_backlog: int = Field(4096, ge=1, le=65535, description=(
        "connections the kernel completes and holds until the server accepts them (capped by "
        "net.core.somaxconn): in a reconnect storm a full queue drops new connections' handshakes, and a "
        "client's retry waits 1, then 2, then 4 s"))
    max_frame_bytes: int = Field(DEFAULT_MAX_FRAME_BYTES, ge=1024)
    default_command_timeout: float = Field(60.0, gt=0)
    # -- files that travel between devices (docs/transfer.md) ----------------------------------------------
    transfer_max_bytes: int = Field(1 << 30, ge=1, description=(
        "the most file data one transfer between devices may carry; a larger one is refused before a byte moves"))
    transfer_chunk_bytes: int = Field(768 * 1024, ge=4096, le=4 * 1024 * 1024, description=(
        "bytes per chunk of a transfer (each chunk is one command to each device; the sender's policy "
        "max_output_bytes caps it too)"))
    transfer_resume_attempts: int = Field(5, ge=0, description=(
        "how often a transfer resumes after a device went away mid-transfer before it fails"))
    transfer_resume_wait: float = Field(60.0, gt=0, description=(
        "seconds a transfer waits for a device that went away to be back before it fails"))
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=ANONYMOUS_BODY_BYTES,
                                description="largest HTTP request body accepted with a valid API token")
    max_response_bytes: int = Field(DEFAULT_MAX_RESPONSE_BYTES, ge=1024, description=(
        "largest REST answer with a batch's results; past it the largest results are replaced by too-large "
        "failures (each result is already capped by the frame limit on its way from the device)"))
    allowed_hosts: list[str] = Field(default_factory=list, description=(
        "host names (or addresses) clients may use in Host and Origin besides localhost, 127.0.0.1, [::1] "
        "and the bind address; '*.example.com' matches its subdomains, '*' turns the check off"))
    tls_cert: str | None = None
    tls_key: str | None = None
    pairing: bool = Field(True, description=(
        "let devices without a token ask to pair (`tether device --pair`); an admin still approves each one"))
    # -- the edge (docs/security/edge.md) --------------------------------------------------------------
    idle_timeout: float = Field(5.0, gt=0, description=(
        "seconds an HTTP connection may stay open with no request under way (just connected and silent, or "
        "between two requests) before the server closes it"))
    header_timeout: float = Field(10.0, gt=0, description=(
        "seconds from a request's first byte to the end of its headers; slower is answered 408 and closed"))
    body_timeout: float = Field(60.0, gt=0, description=(
        "seconds from the end of a request's headers to the end of its body; slower is answered 408 and closed"))
    max_connections_per_address: int = Field(64, ge=1, description=(
        "HTTP connections (not yet a WebSocket) one client address may hold open; more are closed as they are "
        "accepted"))
    max_connections_per_loopback: int | None = Field(None, ge=1, description=(
        "the same cap for a loopback address (127.0.0.0/8, ::1), where local tools and fleets open more; "
        "default: half the server's open-file limit, at most 8,192"))
    max_connections: int | None = Field(None, ge=1, description=(
        "HTTP connections (not yet a WebSocket) from all addresses together; default: three quarters of "
        "the server's open-file limit (`ulimit -n`), so that many addresses together cannot take every descriptor"))
    max_sockets_per_address: int = Field(1024, ge=1, description=(
        "WebSockets (device connections, mostly) one client address may hold: a fleet behind one NAT address "
        "needs this raised; more are answered 503 at the upgrade"))
    max_sockets_per_loopback: int = Field(16384, ge=1, description=(
        "the same cap for a loopback address (a local fleet, the benches' 10,000 devices)"))
    auth_failure_burst: int = Field(30, ge=1, description=(
        "failed credential checks (a wrong bearer token, a failed dashboard login) one client address may make "
        "at once before its requests carrying credentials are answered 429"))
    auth_failures_per_minute: float = Field(30.0, gt=0, description=(
        "how fast that allowance comes back (failed checks per minute, sustained)"))
    pairing_claim_burst: int = Field(20, ge=1, description=(
        "pairing claims one client address may make at once (a waiting device makes about 2 a minute)"))
    pairing_claims_per_minute: float = Field(12.0, gt=0, description=(
        "how fast that allowance comes back (claims per minute, per address; a third of it per code)"))
    allowed_origins: list[str] = Field(default_factory=list, description=(
        "browser origins (scheme://host[:port]) allowed besides the server's own; a page's Origin must match "
        "the server's scheme, host and port otherwise"))
    mcp_authorization_servers: list[str] = Field(default_factory=list, description=(
        "OAuth authorization servers (issuer URLs) named in /mcp's Protected Resource Metadata (RFC 9728); "
        "empty: tether's own API tokens, which need none (docs/gateway.md)"))
    oidc: list[OidcIssuer] = Field(default_factory=list, description=(
        "OpenID Connect issuers whose signed tokens (JWTs) are accepted as API tokens, on the REST API and /mcp, "
        "their claims mapped to scopes, devices and tags (one issuer or a list; docs/oidc.md)"))
    mcp_page_size: int = Field(1000, ge=1, le=10_000, description=(
        "items per page of /mcp's tools/list, resources/list, resources/templates/list and prompts/list (a "
        "longer list is given a page at a time, with nextCursor; large by default, as many clients read only "
        "the first page; docs/gateway.md)"))
    mcp_progressive_over: int = Field(500, ge=0, description=(
        "past this many device tools a client reaches, /mcp's tools/list lists only the fleet and task tools and "
        "find_tools, the search a client finds device tools with (0: always list every tool; docs/gateway.md)"))
    webhooks: list[WebhookConfig] = Field(default_factory=list, description=(
        "the server's own webhooks (the config file's webhooks: list): told of every event they name"))
    webhook_allow_private: bool = Field(False, description=(
        "let webhooks reach private, loopback and link-local addresses (a receiver on this machine or the LAN); "
        "off, such URLs are refused when added and before each send"))
    webhook_timeout: float = Field(10.0, gt=0, le=120, description="seconds one webhook delivery may take")
    webhook_attempts: int = Field(8, ge=1, le=30, description="tries of one delivery before it is failed")
    webhook_retry_s: float = Field(2.0, gt=0, le=3600, description=(
        "the first retry's delay; each later one doubles it (at most an hour)"))
    four_eyes: bool = Field(False, description=(
        "approvals need a second person: the token that asked for an action (created the task, sent the "
        "command) may not approve it; see docs/security/approvals.md"))

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, hosts: list[str]) -> list[str]:
        for entry in hosts:
            text = entry.strip()
            if text != "*" and normalize_host(text.removeprefix("*.")) is None:
                raise ValueError(f"allowed host {entry!r} is not a host name or address (or '*.domain', or '*')")
        return [h.strip().lower() for h in hosts]

    @field_validator("oidc", mode="before")
    @classmethod
    def _oidc(cls, value: object) -> object:
        return issuer_list(value)

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        out = []
        for entry in origins:
            parsed = parse_origin(entry)
            if parsed is None:
                raise ValueError(f"allowed origin {entry!r} is not scheme://host[:port] (http or https)")
            out.append(format_origin(parsed))
        return out

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError(f"heartbeat_timeout ({self.heartbeat_timeout:g}s) must exceed heartbeat_interval "
                             f"({self.heartbeat_interval:g}s), or every device would time out between beats")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        return self

    @field_validator("db_url")
    @classmethod
    def _db_url(cls, url: str | None) -> str | None:
        if url is not None and url.split(":", 1)[0].lower() not in ("postgresql", "postgres"):
            raise ValueError(f"db_url must be a postgresql:// URL, not {url.split(':', 1)[0]}:…")
        return url

    @field_validator("cluster_url")
    @classmethod
    def _cluster_url(cls, url: str | None) -> str | None:
        if url is not None and url.split(":", 1)[0].lower() not in ("redis", "rediss", "unix"):
            raise ValueError(f"cluster_url must be a redis:// URL, not {url.split(':', 1)[0]}:…")
        return url

    @field_validator("cluster_link")
    @classmethod
    def _cluster_link(cls, url: str | None) -> str | None:
        if url is None or url.strip().lower() == "off":
            return None if url is None else "off"
        if url.split(":", 1)[0].lower() not in ("ws", "wss"):
            raise ValueError(f"cluster_link must be a ws:// or wss:// URL or 'off', not {url!r}")
        return url.strip()

    @field_validator("node_id")
    @classmethod
    def _node_id(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]*", name):
            raise ValueError(f"{name!r} is not a node name: letters, digits, '.', '_', ':' and '-', starting with a "
                             "letter or digit")
        return name

    @property
    def node(self) -> str:
        """This server's name among its peers: `node_id` when set, else one stable across restarts of the
        same server (host, state directory and database), so a restarted server is the same node and
        takes its own tasks back at once instead of waiting for their leases to run out."""
        if self.node_id:
            return self.node_id
        state = os.environ.get("TETHER_STATE_DIR") or os.environ.get("XDG_STATE_HOME") or str(Path.home())
        where = f"{state}|{self.db_url or Path(self.db_path).expanduser().resolve()}"
        return f"{socket.gethostname()}:{hashlib.sha256(where.encode()).hexdigest()[:12]}"

    @property
    def lease_s(self) -> float:
        """How long a node's claims (its devices in Redis, its tasks in the database) outlive its last
        renewal. Renewed every third of it, so a node must stall two thirds of it to lose them; and short
        enough that another node owns a dead node's tasks within the heartbeat timeout + grace period
        (expiry plus one renewal period of the taker: 4/3 of the heartbeat timeout at worst)."""
        return self.heartbeat_timeout

    @property
    def db_target(self) -> str | Path:
        """What the stores open: the PostgreSQL URL when there is one, else the SQLite file."""
        return self.db_url or self.db_path

    @property
    def loopback(self) -> bool:
        """Whether the server only listens on this machine (then it may start with no tokens yet)."""
        return is_loopback(self.host)

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None
