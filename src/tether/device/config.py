"""Device configuration: seed 003's YAML (`mcp: agent → root → data_collection/action`) and the
`mcpServers` JSON that desktop MCP clients use, so people can reuse the configs they already have.

A desktop client's file (Claude Desktop, Cline, Roo Code, ...) is read as it is: its own top-level
settings (`globalShortcut`, `preferences`, ...) are ignored with a log line, and an entry's
`autoApprove` (Roo Code: `alwaysAllow`) becomes the server's `auto_approve`. tether's own keys for
external servers (`allow_tools`, `deny_tools`, `approve_tools`, `approve_destructive`, `sandbox`)
may be added to an entry too. A file that also has tether's own sections stays strict about
unknown keys: there a typo must not silently drop a setting.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tether import yaml12
from tether.device.mcp.config.server_config import MCPServerConfig
from tether.protocol.models import TOOL_TYPES, ToolType

logger = logging.getLogger(__name__)

DEFAULT_AGENT = "default"
DEFAULT_ROOT = "default"
BUILTIN_SETS = ("shell", "files", "system", "transfer", "desktop", "browser")


class RootConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_collection: list[MCPServerConfig] = Field(default_factory=list)
    action: list[MCPServerConfig] = Field(default_factory=list)

    def servers(self) -> list[tuple[ToolType, MCPServerConfig]]:
        return [("data_collection", c) for c in self.data_collection] + [("action", c) for c in self.action]


def aip_url(url: str) -> str:
    """A server URL as the device connects to it: http(s):// becomes ws(s)://, and the path ends in /aip."""
    url = url.strip()
    if url.startswith(("http://", "https://")):
        url = "ws" + url[4:]
    return url if url.rstrip("/").endswith("/aip") else url.rstrip("/") + "/aip"


def server_url_problem(url: str) -> str | None:
    """Why `url` (a `--server` value or a config's server URL) cannot be a device's server URL, in one line
    naming it with its control characters escaped (`\\x1b`); None when it can (ws://, wss://, http:// or
    https://, a host, a numeric port if any)."""
    shown = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in url)
    usage = "it must look like ws://HOST:PORT (or wss://, http://, https://)"
    if shown != url:
        return f"'{shown}' is not a usable server URL (it holds control characters); {usage}"
    try:
        parts = urlsplit(aip_url(url))
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        return f"'{shown}' is not a usable server URL ({exc}); {usage}"
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        return f"'{shown}' is not a usable server URL; {usage}"
    return None


class ServerEndpoint(BaseModel):
    """Where `tether device` connects (seed 002's client config): a URL, or host/port/protocol."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    urls: list[str] = Field(default_factory=list, description=(
        "several servers' AIP URLs (a cluster's nodes): the device uses one and moves to the next when it is "
        "lost; instead of url"))
    host: str = "127.0.0.1"
    port: int = 8765
    protocol: str = Field("ws", pattern="^wss?$")
    token: str | None = None
    token_file: str | None = None
    ca_file: str | None = None
    key_file: str | None = Field(None, description=(
        "the device's Ed25519 private key (made on first use, 0600), relative to the config file; default "
        "device.key in the state directory. The sandbox hides it from every tool, like the token"))

    def ws_urls(self) -> list[str]:
        """Every URL the device may use, in order: `urls` when given, else the one `ws_url()`."""
        if self.urls and self.url:
            raise ValueError("the config's server: section has both url and urls: give one")
        return [aip_url(u) for u in self.urls] if self.urls else [self.ws_url()]

    def ws_url(self) -> str:
        if self.url:
            return self.url if self.url.rstrip("/").endswith("/aip") else self.url.rstrip("/") + "/aip"
        return f"{self.protocol}://{self.host}:{self.port}/aip"

    def key_path(self, state_dir: Path, base: Path | None = None) -> Path:
        """Where the device's key is kept: `key_file` (relative to `base`, the config's directory), else
        `device.key` in `state_dir`."""
        if not self.key_file:
            return state_dir / "device.key"
        path = Path(self.key_file).expanduser()
        return base / path if not path.is_absolute() and base is not None else path

    def read_token(self, base: Path | None = None) -> str | None:
        if self.token:
            return self.token
        if self.token_file:
            path = Path(self.token_file).expanduser()
            if not path.is_absolute() and base is not None:
                path = base / path
            try:
                return path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ValueError(f"cannot read token file {path}: {exc.strerror or exc}") from exc
        return None


class DeviceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    platform: str | None = Field(None, description="informational; the profile reports the real one")
    tags: list[str] = Field(default_factory=list)
    state_dir: str | None = None
    policy: str | dict[str, Any] | None = Field(None, description="a policy file path or an inline policy")
    builtin: list[str] = Field(default_factory=lambda: list(BUILTIN_SETS),
                               description="built-in tool sets every agent gets in its default root")
    # a root device (docs/security/root.md): local settings only, never pushed from a server
    allow_root: bool = Field(False, description=(
        "let the device run as root (as --allow-root or TETHER_ALLOW_ROOT=1); its sandboxed processes then "
        "run as run_as"))
    run_as: str | None = Field(None, description=(
        "the user a root device runs sandboxed processes as (a name or uid; TETHER_RUN_AS wins): default "
        "'tether' if that user exists, else 'nobody'; 'root' keeps them root (warned)"))


class DeviceConfig(BaseModel):
    """The whole device config. Agents' roots fall back to `default`; an unknown agent is an error."""

    model_config = ConfigDict(extra="forbid")

    device: DeviceSettings = Field(default_factory=DeviceSettings)
    server: ServerEndpoint = Field(default_factory=ServerEndpoint)
    mcp: dict[str, dict[str, RootConfig]] = Field(default_factory=dict)
    source: str | None = Field(None, exclude=True)
    disabled_servers: list[str] = Field(default_factory=list, exclude=True)  # mcpServers entries with disabled: true

    def root(self, agent_name: str, root_name: str | None) -> tuple[str, RootConfig]:
        agent = self.mcp.get(agent_name)
        if agent is None:
            raise ValueError(f"unknown agent '{agent_name}'; configured agents: {sorted(self.mcp)}")
        if root_name and root_name in agent:
            return root_name, agent[root_name]
        if DEFAULT_ROOT not in agent:
            raise ValueError(f"agent '{agent_name}' has no '{root_name}' root and no 'default' root")
        return DEFAULT_ROOT, agent[DEFAULT_ROOT]


def _builtin_entries(names: list[str]) -> list[MCPServerConfig]:
    unknown = [n for n in names if n not in BUILTIN_SETS]
    if unknown:
        raise ValueError(f"unknown built-in tool set(s) {unknown}; available: {list(BUILTIN_SETS)}")
    return [MCPServerConfig(namespace=n, server_type="local", toolset=n) for n in names]


# an entry's keys that put its tools under the policy (`tether.device.mcp.config.tool_rules`), as in MCPServerConfig
_TOOL_RULE_KEYS = ("allow_tools", "deny_tools", "approve_tools", "approve_destructive", "sandbox")
_AUTO_APPROVE_KEYS = ("autoApprove", "alwaysAllow", "auto_approve")  # Cline/Claude Code, Roo Code, tether
# an entry's `type` (Claude Code, VS Code, Cursor; Cline's `transport`) as tether's server_type; None: by its keys
_KINDS: dict[str | None, str | None] = {None: None, "stdio": "stdio", "http": "http", "streamable-http": "http",
                                        "streamableHttp": "http", "sse": "sse"}


def _from_mcp_servers(entries: dict[str, Any], disabled: list[str] | None = None
                      ) -> tuple[list[MCPServerConfig], list[MCPServerConfig]]:
    """Translate `{"mcpServers": {name: {command, args, env} | {url, headers}}}` into server configs; the
    names of entries that are `disabled` go to `disabled`."""
    data: list[MCPServerConfig] = []
    action: list[MCPServerConfig] = []
    disabled = [] if disabled is None else disabled
    for name, spec in entries.items():
        if not isinstance(spec, dict):
            raise ValueError(f"mcpServers.{name}: expected an object, got {type(spec).__name__}")
        spec = dict(spec)
        tool_type = spec.pop("toolType", spec.pop("tool_type", "action"))
        if tool_type not in TOOL_TYPES:
            raise ValueError(f"mcpServers.{name}.toolType must be one of {TOOL_TYPES}")
        kind = spec.pop("type", spec.pop("transport", None))
        if spec.pop("disabled", False):
            logger.info("mcpServers.%s is disabled: not started", name)
            disabled.append(name)
            continue
        if not isinstance(kind, str | None) or kind not in _KINDS:
            raise ValueError(f"mcpServers.{name}.type {kind!r} is not one of stdio, http, sse")
        rules = {key: spec.pop(key) for key in _TOOL_RULE_KEYS if key in spec}
        auto: list[str] = []
        for key in _AUTO_APPROVE_KEYS:
            names = spec.pop(key, [])
            if not isinstance(names, list):
                raise ValueError(f"mcpServers.{name}.{key}: expected a list of tool names")
            auto += names
        if auto:
            rules["auto_approve"] = auto
        if _KINDS[kind] in ("http", "sse") or (kind is None and "url" in spec):
            cfg = MCPServerConfig(namespace=name, server_type=_KINDS[kind] or "http", url=spec.pop("url", None),
                                  headers=spec.pop("headers", {}), timeout=spec.pop("timeout", None), **rules)
        else:
            cfg = MCPServerConfig(namespace=name, server_type="stdio", command=spec.pop("command", None),
                                  args=spec.pop("args", []), env=spec.pop("env", None),
                                  cwd=spec.pop("cwd", None), timeout=spec.pop("timeout", None), **rules)
        if spec:  # per server stays strict: an unknown key may be a rule that would silently not apply
            raise ValueError(f"mcpServers.{name}: unsupported key(s) {sorted(spec)}")
        (data if tool_type == "data_collection" else action).append(cfg)
    return data, action


SECTIONS = ("llm", "device", "server", "policy", "mcp", "mcpServers")  # the one config file's top level


def parse_device_config(raw: dict[str, Any] | None, source: str | None = None) -> DeviceConfig:
    """Build a config from the one config file (sections `llm:`, `device:`, `server:`, `policy:`, `mcp:`,
    `mcpServers:`) or a desktop client's mcpServers file; built-in sets join every default root.
    `llm:` is the planner's (`tether.agent.llm.chat.resolve_llm_settings` reads it from the same file);
    `policy:` is the device's policy, inline, as `device.policy` may also be."""
    raw = dict(raw or {})
    mcp_servers = raw.pop("mcpServers", None)
    where = f" in {source}" if source else ""
    own = set(DeviceConfig.model_fields) - {"source", "disabled_servers"}
    if mcp_servers is not None and not own.intersection(raw) and not {"llm", "policy"} & set(raw):
        ignored = sorted(raw, key=str)  # a desktop client's file, read as it is
        if ignored:
            # a warning, so the CLI's default level shows it: a setting someone expected to act is not read
            logger.warning("device config%s: ignoring the desktop client's own settings %s", where,
                           [yaml12.shown_key(key) for key in ignored])
        raw = {}
    raw.pop("llm", None)
    policy = raw.pop("policy", None)
    unknown = sorted(set(raw) - own, key=str)
    if unknown:
        raise ValueError(f"config file{where}: unknown section(s) {', '.join(map(yaml12.shown_key, unknown))}; "
                         f"the sections are {', '.join(SECTIONS)}")
    if policy is not None:
        device = dict(raw.get("device") or {})
        if device.get("policy") is not None:
            raise ValueError(f"config file{where}: the policy is given twice (policy: and device.policy:); keep one")
        raw["device"] = {**device, "policy": policy}
    try:
        config = DeviceConfig.model_validate(raw)
        builtin = _builtin_entries(config.device.builtin)
        extra_data, extra_action = _from_mcp_servers(mcp_servers or {}, config.disabled_servers)
    except (ValidationError, ValueError) as exc:
        raise ValueError(f"invalid device config{where}: {exc}") from exc
    if not config.mcp:
        config.mcp[DEFAULT_AGENT] = {DEFAULT_ROOT: RootConfig()}
    for roots in config.mcp.values():
        root = roots.setdefault(DEFAULT_ROOT, RootConfig())
        taken = {c.namespace for _, c in root.servers()}
        root.action[:0] = [c for c in builtin if c.namespace not in taken]
        root.data_collection.extend(extra_data)
        root.action.extend(extra_action)
    config.source = source
    return config


ENV_CONFIG = "TETHER_CONFIG"


def config_file(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Path | None:
    """The config file to read: `path` (--config), else $TETHER_CONFIG, else ~/.config/tether/config.yaml
    ($XDG_CONFIG_HOME) if it exists. A file named on purpose (the flag or the variable) must exist."""
    env = os.environ if env is None else env
    if path is not None:
        named, why = Path(path).expanduser(), "the config file"
    elif env.get(ENV_CONFIG):
        named, why = Path(env[ENV_CONFIG]).expanduser(), f"{ENV_CONFIG}"
    else:
        base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
        default = Path(base) / "tether" / "config.yaml"
        return default if default.is_file() else None
    if not named.is_file():
        raise ValueError(f"{why} {named} does not exist" if why != ENV_CONFIG else
                         f"{ENV_CONFIG} names {named}, which does not exist (unset it to use no config file)")
    return named


def load_device_config(path: str | os.PathLike[str] | None) -> DeviceConfig:
    """Read a YAML or JSON file (None: $TETHER_CONFIG or the default file, if any; else the defaults).
    Errors name the file and what is wrong."""
    if path is None:
        found = config_file(None)
        if found is None:
            return parse_device_config({})
        path = found
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read device config {p}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"device config {p} is not UTF-8 text: {yaml12.where_and_why(exc)}") from None
    import yaml  # only with a config file: a device without one never loads it

    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml12.safe_load(text)
    except json.JSONDecodeError as exc:  # its words name the line and column only
        raise ValueError(f"device config {p} is not valid JSON: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"device config {p} is not valid YAML: {yaml12.where_and_why(exc)}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"device config {p} must be a mapping at the top level")
    return parse_device_config(raw, str(p))
