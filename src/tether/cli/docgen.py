"""Writes docs/configuration.md from the pydantic models that read the configuration, so the reference
cannot drift from the code: `python -m tether.cli.docgen` rewrites it, `--check` says whether it is stale
(tests/cli/test_config_doc.py runs the check). A field with no `description` in its model needs a line in
`NOTES` here, or the generator refuses: every key gets its sentence."""

from __future__ import annotations

import importlib
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


@dataclass(frozen=True)
class Section:
    title: str
    model: str  # "module:Class"
    prefix: str  # how the keys are written in the file, e.g. "llm." or "" for a file of its own
    intro: str


SECTIONS: tuple[Section, ...] = (
    Section("The LLM (`llm:`)", "tether.agent.llm.settings:_LLMSection", "llm.",
            "Where the planner's LLM is: any OpenAI-compatible endpoint. `TETHER_LLM_BASE_URL`, "
            "`TETHER_LLM_MODEL` and `TETHER_LLM_API_KEY` (or `OPENAI_API_KEY`) in the environment win over the "
            "file. `base_url` and `model` are required once the section is there."),
    Section("The device (`device:`)", "tether.device.config:DeviceSettings", "device.",
            "Who this machine is to a server, and which built-in tools its agents get."),
    Section("Where the device connects (`server:`)", "tether.device.config:ServerEndpoint", "server.",
            "Read by `tether device`. A token belongs in `token_file` (or `TETHER_DEVICE_TOKEN`), "
            "never on a command line."),
    Section("An MCP server entry (`mcp:`)", "tether.device.mcp.config.server_config:MCPServerConfig",
            "mcp.<agent>.<root>.action[].",
            "Each agent's roots list their MCP servers under `action` or `data_collection` (the `default` root "
            "is used when a root is not named). The same keys in `mcpServers:` (the Claude Desktop / Cursor "
            "format) are translated: `command`, `args`, `env`, `url`, `headers`, `toolType`, `autoApprove`."),
    Section("The policy", "tether.tools.policy.model:Policy", "",
            "A policy file (`--policy FILE`), the device config's `device.policy` (a path or inline), or a "
            "server's push (`tether policy set`). Every key has a safe default; a key not listed is an error."),
    Section("The agent server (`tether server`)", "tether.server.settings:ServerSettings", "",
            "Set by `tether server`'s options of the same name (`--db` for `db_path`, or `db_url` when it is a "
            "`postgresql://` URL; `--tls-cert`, "
            "`--tls-key`), any other with `--set KEY=VALUE`; the edge's settings are explained in "
            "[security/edge.md](security/edge.md)."),
)

# Fields whose model has no description: their line, keyed "Class.field".
NOTES: dict[str, str] = {
    "_LLMSection.base_url": "the endpoint, e.g. https://api.openai.com/v1 or http://127.0.0.1:11434/v1 (Ollama)",
    "_LLMSection.model": "the model name the endpoint knows",
    "_LLMSection.api_key": "the key itself (better: `api_key_env`, or TETHER_LLM_API_KEY in the environment)",
    "_LLMSection.timeout": "seconds one LLM call may take",
    "_LLMSection.max_retries": "retries of a failed LLM call",
    "_LLMSection.temperature": "sampling temperature (0: the most repeatable plans)",
    "_LLMSection.api_key_env": "the name of an environment variable holding the key",
    "DeviceSettings.name": "the device's name on the server (must match its token's)",
    "DeviceSettings.tags": "tags for device selection (`tether run --require tag=NAME`)",
    "DeviceSettings.state_dir": "where the undo journal and the device's state live",
    "ServerEndpoint.url": "the server's AIP URL (ws:// or wss://…/aip); else host, port and protocol",
    "ServerEndpoint.host": "the server's host",
    "ServerEndpoint.port": "the server's port",
    "ServerEndpoint.protocol": "ws or wss",
    "ServerEndpoint.token": "the device token inline (better: token_file)",
    "ServerEndpoint.token_file": "a file holding the device token (relative to the config file)",
    "ServerEndpoint.ca_file": "a CA certificate to verify a self-signed server",
    "ServerEndpoint.key_file": "the device's private key (default: device.key in the state directory); hidden "
                               "from the sandbox",
    "MCPServerConfig.namespace": "the namespace its tools are listed and called under",
    "MCPServerConfig.server_type": "local (in-process), stdio (a process) or http (streamable HTTP)",
    "MCPServerConfig.args": "stdio: the arguments",
    "MCPServerConfig.env": "stdio: extra environment variables",
    "MCPServerConfig.cwd": "stdio: the working directory",
    "MCPServerConfig.headers": "http: headers sent with every request (e.g. Authorization)",
    "MCPServerConfig.startup_timeout": "seconds the server may take to start and list its tools",
    "ApprovalRules.delete": "deleting a file needs a person's approval",
    "ApprovalRules.move": "moving a file needs a person's approval",
    "ApprovalRules.overwrite_outside_temp": "overwriting a file outside the temp directory needs a person's approval",
    "Policy.commands": "the shell allowlist: program name → its argument rules (below)",
    "Policy.allow_inline_code": "let interpreters run code given inline (python -c, sh -c …)",
    "Policy.allow_escapes": "escape routes the shell checks refuse by default, lifted by name",
    "Policy.read_roots": "where read tools and commands may read",
    "Policy.write_roots": "where tools and commands may write (changes captured, approvable, undoable)",
    "Policy.approval": "which file changes need a person's approval (below)",
    "Policy.max_output_bytes": "largest output a command returns",
    "Policy.default_timeout": "seconds a command may run when its call names no timeout",
    "ServerSettings.host": "address to listen on (off loopback: tokens and TLS required)",
    "ServerSettings.port": "port to listen on",
    "ServerSettings.db_path": "the SQLite database: tasks, tokens, the audit log",
    "ServerSettings.max_frame_bytes": "largest AIP frame accepted",
    "ServerSettings.default_command_timeout": "seconds a command may take when its call names no timeout",
    "ServerSettings.tls_cert": "PEM certificate (chain): serve HTTPS and wss",
    "ServerSettings.tls_key": "PEM private key of tls_cert",
}

# Defaults that depend on the machine, said in words so the page is the same everywhere.
DEFAULTS: dict[str, str] = {
    "Policy.read_roots": "`~` and the temp directory",
    "Policy.write_roots": "`~` and the temp directory",
    "ServerSettings.db_path": "`server.db` in the state directory (`~/.local/state/tether`)",
    "ServerSettings.max_connections_per_loopback": "half the open-file limit, at most 8,192",
    "ServerSettings.max_connections": "three quarters of the open-file limit",
}


def _load(spec: str) -> type:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _model_in(annotation: Any) -> tuple[str, type] | None:
    """(how its keys nest, the model) when a field holds a model, a list of them or a dict of them."""
    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return ".", annotation
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args and isinstance(args[0], type) and issubclass(args[0], BaseModel):
        return "[].", args[0]
    if origin is dict and len(args) == 2 and isinstance(args[1], type) and issubclass(args[1], BaseModel):
        return ".<name>.", args[1]
    return None


def _type(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(annotation))
    origin = typing.get_origin(annotation)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type(a) for a in typing.get_args(annotation))}]"
    return str(annotation).replace("typing.", "")


def _default(key: str, field: Any) -> str:
    if key in DEFAULTS:
        return DEFAULTS[key]
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if hasattr(value, "model_dump"):
        return "see below"
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    return f"`{text}`"


def _rows(model: type, prefix: str, out: list[str], nested: list[tuple[str, type]]) -> None:
    for name, field in model.model_fields.items():  # type: ignore[attr-defined]
        if field.exclude:
            continue
        key = f"{model.__name__}.{name}"
        text = field.description or NOTES.get(key)
        if not text:
            raise ValueError(f"{key} has no description: give it one in the model, or a line in docgen.NOTES")
        out.append(f"| `{prefix}{name}` | {_type(field.annotation)} | {_default(key, field)} | "
                   f"{text.replace('|', chr(92) + '|')} |")
        inner = _model_in(field.annotation)
        if inner is not None:
            nested.append((f"{prefix}{name}{inner[0]}", inner[1]))


def render() -> str:
    lines = ["# Configuration reference", "",
             "Generated from the models that read these settings (`python -m tether.cli.docgen`); a test fails "
             "when it is stale. One file holds the sections (`tether run --config FILE`, or `TETHER_CONFIG`, "
             "else `~/.config/tether/config.yaml`).", ""]
    for section in SECTIONS:
        lines += [f"## {section.title}", "", section.intro, ""]
        todo: list[tuple[str, type]] = [(section.prefix, _load(section.model))]
        while todo:
            prefix, model = todo.pop(0)
            rows: list[str] = []
            nested: list[tuple[str, type]] = []
            _rows(model, prefix, rows, nested)
            if prefix != section.prefix:
                lines += [f"### `{prefix.rstrip('.')}`", ""]
            lines += ["| key | type | default | what |", "| --- | --- | --- | --- |", *rows, ""]
            todo += nested
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not DOC.is_file() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is stale: run python -m tether.cli.docgen", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
