"""What the `tether` commands share that needs neither typer nor click: exit codes, a usage error that exits,
`key=value` arguments, a tool's result and live output on the terminal, the root guard. `tether.cli.common`
re-exports these names; the commands with a typer-free fast path (`tether.cli.fast`) import them from here so
that running them never imports typer."""

from __future__ import annotations

import json
import re
import sys
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rich.markup import escape

from tether.cli.views.safe_text import console, say, visible

if TYPE_CHECKING:
    from tether.client.rest import RemoteError  # httpx: imported by the commands that talk to a server
    from tether.device.config import DeviceConfig
    from tether.protocol.models import Result  # pydantic: not for `tether --help`


class ExitCode(IntEnum):
    """tether's exit codes, the same in every command (README, "Exit codes")."""

    OK = 0
    FAILED = 1  # the task, command or request failed, or the server refused it
    USAGE = 2  # bad arguments, or a bad config, policy or plan file (click's usage errors are 2 as well)
    WAITING = 3  # a person must act: a question left unanswered, an approval pending
    UNREACHABLE = 4  # the server could not be reached, or the connection to it was lost
    # Ctrl-C (SIGINT), as a shell reports it (typer's own code for an interrupted command too): a server's task
    # goes on
    INTERRUPTED = 130


INTERRUPTED = ExitCode.INTERRUPTED


def usage_error(message: str, code: int = ExitCode.USAGE) -> NoReturn:
    """Say `message` as `tether.cli.common.fail` does (`error: …` on stderr, plain text, never markup) and exit
    with `code` (`SystemExit`, which typer and the fast path alike pass on as the process's exit code)."""
    say(f"error: {message}", err=True)
    raise SystemExit(int(code))


def load_config(path: Path | None) -> DeviceConfig:
    """The device config of a command that runs a device in this process (`tether.device.config.
    load_device_config`: `--config`, else $TETHER_CONFIG or the default file), read once and passed to what
    needs it (`guard_root`, the state directory's lock, the device). One it cannot read or use: one line on
    stderr and exit `ExitCode.USAGE` (`SystemExit`)."""
    from tether.device.config import load_device_config

    try:
        return load_device_config(path)
    except ValueError as exc:
        say(f"error: {exc}", err=True, soft_wrap=True)  # one line, whatever the terminal's width
        raise SystemExit(int(ExitCode.USAGE)) from None


def guard_root(config: DeviceConfig, allow_root: bool, command: str) -> None:
    """For the commands that run a device in this process (`tether exec`, `tether run`; tether.device.root,
    docs/security/root.md), with the device's config (`load_config`). Not root: nothing. Root without leave:
    one line on stderr and exit `ExitCode.USAGE` (`SystemExit`). Root with leave: a one-line warning naming who
    sandboxed commands run as."""
    import os

    if os.geteuid() != 0:
        return
    from tether.device.root import RootRefused, root_check

    try:
        warning = root_check(config, allow_root, command)
    except (ValueError, RootRefused) as exc:
        say(f"error: {exc}", err=True, soft_wrap=True)  # one line, whatever the terminal's width
        raise SystemExit(int(ExitCode.USAGE)) from None
    if warning:
        say(f"warning: {warning}", err=True, soft_wrap=True)


def remote_message(exc: RemoteError) -> str:
    """The server's refusal in CLI terms: what to set or pass, not which HTTP header to send."""
    text = str(exc)
    if exc.status == 401 and "missing bearer token" in text:
        return ("no API token: set TETHER_TOKEN or pass --token (on the server's machine, "
                "'tether token create --api NAME' makes one)")
    if exc.status == 401 and "unknown or revoked token" in text:
        return "the API token (TETHER_TOKEN or --token) is unknown or revoked: 'tether token list' shows the live ones"
    if exc.status == 403 and (scope := re.search(r"lacks the '(\w+)' scope", text)):
        return (f"{text.removeprefix('server answered 403: ')}: use a token that has it "
                f"('tether token create --api NAME --scope {scope.group(1)}' on the server's machine)")
    if exc.status is None and "cannot reach" in text:
        return f"{text}\n  {unreachable_hint(text)}"
    return text.replace("('Authorization: Bearer <api token>')", "(set TETHER_TOKEN or pass --token)")


def unreachable_hint(text: str) -> str:
    """What to check when the server was not reached, from the error's words: a URL without its scheme,
    a TLS failure (an untrusted certificate or a pin that does not match), a refused connection (is the
    server running?), or else where the URL comes from."""
    lowered = text.lower()
    if "missing an 'http://' or 'https://' protocol" in lowered or "unsupported protocol" in lowered:
        return "the server URL needs its scheme: --server http://HOST:PORT (https:// with TLS)"
    if any(word in lowered for word in ("ssl", "certificate", "tls", "fingerprint", "pinned", "pin mismatch")):
        return ("a TLS problem, not a server that is down: for a self-signed certificate pass its CA with --ca-file "
                "(or TETHER_CA_FILE); check that a pinned fingerprint is the server's ('tether server' prints it)")
    if "refused" in lowered:
        return "is it running ('tether server')? --server or TETHER_SERVER say where it is"
    return "--server or TETHER_SERVER say where it is (check the host name and port)"


def remote_exit_code(exc: RemoteError, code: int = ExitCode.FAILED) -> int:
    """The exit code for a server's no, the same from every command: `ExitCode.UNREACHABLE` when it was not
    reached, `ExitCode.USAGE` for no token or a dead one, `ExitCode.FAILED` for a token that lacks the scope
    the command needs (the server refused it, README "Exit codes"), else `code` (the command's own)."""
    if exc.status is None:
        return ExitCode.UNREACHABLE
    if exc.status == 401:
        return ExitCode.USAGE
    if exc.status == 403 and "lacks the '" in str(exc):
        return ExitCode.FAILED
    return code


def check_tool_type(tool_type: str | None) -> None:
    """`--type`: None, data_collection or action; else a usage error (`usage_error`)."""
    if tool_type not in (None, "data_collection", "action"):
        usage_error("--type must be data_collection or action")


MAX_TIMEOUT_S = 86400.0  # a day: the most a server waits for a batch (its `timeout` field)


def check_timeout(timeout: float | None) -> None:
    """`--timeout`: None, or seconds from 0 (the default) to `MAX_TIMEOUT_S`; else a usage error (`usage_error`:
    infinity, NaN or a negative number is never sent or waited on)."""
    if timeout is not None and not 0 <= timeout <= MAX_TIMEOUT_S:
        usage_error(f"--timeout must be a number of seconds from 0 to {MAX_TIMEOUT_S:.0f} (a day), not {timeout}")


def parse_assignments(pairs: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    """`key=value` (JSON where the parameter is not a string, else text) and `key:=json` (always JSON).
    ValueError (a usage error) for a pair that is neither, a key given twice, or `key:=` JSON that is not."""
    props = schema.get("properties", {})
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        raw_json = key.endswith(":")
        key = key.removesuffix(":")
        if not sep or not key:
            raise ValueError(f"argument {pair!r} is not key=value (or key:=json)")
        if key in out:
            raise ValueError(f"argument {key} is given twice: give each key once")
        if raw_json:
            try:
                out[key] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"argument {key}: not valid JSON: {exc.msg}") from exc
            continue
        if _wants_string(props.get(key, {})):
            out[key] = value
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _wants_string(prop: dict[str, Any]) -> bool:
    types = {prop.get("type")} | {p.get("type") for p in prop.get("anyOf", [])}
    types.discard(None)
    types.discard("null")
    return types == {"string"}


def stream_output(kind: str, data: dict[str, Any], raw: bool = False) -> None:
    """Live stdout/stderr of a running command, on the terminal only (results carry it anyway); its control
    characters shown as escapes but `\n` and `\t` (`safe_text.visible`) unless `raw`."""
    if kind == "output" and sys.stderr.isatty():
        data_text = str(data.get("data", ""))
        sys.stderr.write(data_text if raw else visible(data_text))
        sys.stderr.flush()
    elif kind == "queued":  # the device runs as many sessions as it may: this one waits in line
        sys.stderr.write(f"waiting: the device is busy; number {data.get('position')} in line\n")
        sys.stderr.flush()
    elif kind == "starting":  # the tool may be an external MCP server's that the device is still starting
        servers = visible(", ".join(map(str, data.get("servers") or [])), one_line=True)
        sys.stderr.write(f"waiting: MCP server(s) still starting on the device: {servers}\n")
        sys.stderr.flush()
    elif kind == "progress":  # an external MCP tool's progress: not in the result, so always shown
        sys.stderr.write(progress_line(data) + "\n")
        sys.stderr.flush()


def progress_line(data: dict[str, Any]) -> str:
    """`progress server.tool: 2/3 step 2 of 3` (plain text: a server's message is never markup)."""
    done, total = data.get("progress"), data.get("total")
    amount = f"{done:g}/{total:g}" if isinstance(done, int | float) and isinstance(total, int | float) else (
        f"{done:g}" if isinstance(done, int | float) else "")
    message = str(data.get("message") or "").replace("\n", " ")[:300]
    return visible(f"progress {data.get('server', '?')}.{data.get('tool', '?')}: {amount} {message}".rstrip(),
                   one_line=True)


def print_result(result: Result, session_id: str | None, device: str | None = None, raw: bool = False) -> None:
    """A tool's result. Its stdout and stderr are shown with control characters as escapes (but `\n` and
    `\t`) unless `raw`, which writes them as the command wrote them."""
    out = console()
    style = {"success": "green", "failure": "red", "skipped": "yellow"}.get(result.status.value, "white")
    shown = "outcome pending" if result.outcome_pending else result.status.value  # not a failure: docs/outcomes.md
    style = "yellow" if result.outcome_pending else style
    where = f"  device={escape(device)}" if device else ""
    out.print(f"[{style}]{shown}[/{style}]{where}  namespace={escape(str(result.namespace))}  "
              f"call_id={result.call_id}  session={session_id}")
    if result.error:
        say(f"error: {result.error}")
    payload = result.result
    if isinstance(payload, dict) and ("stdout" in payload or "stderr" in payload):
        for stream in ("stdout", "stderr"):
            if payload.get(stream):
                out.print(f"[bold]{stream}:[/bold]")
                body = str(payload[stream])
                if raw:
                    sys.stdout.write(body if body.endswith("\n") else body + "\n")
                    sys.stdout.flush()
                else:
                    out.out(body, end="" if body.endswith("\n") else "\n")
        rest = {k: v for k, v in payload.items() if k not in ("stdout", "stderr")}
        out.print_json(json.dumps(rest, default=str))
    elif payload is not None:
        out.print_json(json.dumps(payload, default=str))
