"""`tether exec --all`: one tool call on every device the server has that meets `--require`.

The server streams one NDJSON line per device as it finishes (`POST /api/v1/fleet/commands`); here
they drive a live progress bar with the counts so far, then each successful device's output with
identical outputs folded into one block naming their devices (as Ansible and pssh do), the summary
table, and every device that did not succeed with its error. With `--json` the lines are printed as
they come, for scripts.

Exit codes: 0 when every device succeeded; 1 (`ExitCode.FAILED`) when any device failed, was offline,
timed out or was cancelled, or the server refused the fan-out (e.g. no device fits); 2 for bad
arguments; 4 when the server cannot be reached or the stream is cut. Ctrl-C closes the stream, which
cancels the fan-out and the commands still running on the devices.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import typer
from rich.markup import escape

from tether.cli.common import INTERRUPTED, ExitCode, console, fail, fail_remote, parse_requires
from tether.protocol.models import Command

STATUSES = ("ok", "failed", "offline", "timed_out", "cancelled")
MAX_LINE = 64 << 20  # one device's line (the server caps it by max_response_bytes, well below this)
SHOWN_FAILURES = 50
SHOWN_OUTPUTS = 50  # distinct outputs printed; the rest are counted (--json has every device's)
OUTPUT_LINES = 40  # lines of one output printed


def exec_all(command: Command, requires: list[str], *, timeout: float | None, max_concurrency: int | None,
             as_json: bool, server: str | None, token: str | None, ca_file: str | None) -> None:
    """Fan the command out and render it; raises `typer.Exit` with the exit code described above."""
    from tether.client.rest import RemoteError, RemoteServer

    try:
        req = parse_requires(requires)
    except ValueError as exc:
        fail(str(exc))  # plain text: fail() never reads markup
    body: dict[str, Any] = {"requires": req, "commands": [command.model_dump(exclude_none=True)],
                            "timeout": timeout or 60.0}
    if max_concurrency is not None:
        body["max_concurrency"] = max_concurrency
    summary: dict[str, Any] | None = None
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            summary = _follow(remote, body, as_json)
    except RemoteError as exc:  # the server's words may carry device names: printed, never read as markup
        fail_remote(exc, ExitCode.FAILED)
    except KeyboardInterrupt:
        fail("interrupted: the fan-out was cancelled, with the commands still running on its devices",
             INTERRUPTED)
    if summary is None:
        fail("the server closed the stream before the summary; the audit log has what ran", ExitCode.UNREACHABLE)
    if any(summary.get(s) for s in STATUSES[1:]):
        raise typer.Exit(ExitCode.FAILED)


def _lines(remote: Any, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    import httpx

    from tether.client.rest import RemoteError

    timeout = httpx.Timeout(body["timeout"] + 30, connect=10)
    try:
        with remote._http.stream("POST", "/fleet/commands", json=body, timeout=timeout,
                                 headers={"Accept": "application/x-ndjson"}) as response:
            if response.is_error:
                response.read()
                remote._decode(response)
            for line in response.iter_lines():
                if len(line) > MAX_LINE:
                    raise RemoteError(f"a line of {len(line)} bytes from the server is past the limit")
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError:
                        raise RemoteError(f"the server sent a line that is not JSON: {line[:200]!r}") from None
    except httpx.ConnectError as exc:
        raise RemoteError(f"cannot reach the tether server at {remote.base_url}: {exc}") from None
    except httpx.HTTPError as exc:
        raise RemoteError(f"lost the connection to {remote.base_url} during the fan-out: {exc}") from None


def _follow(remote: Any, body: dict[str, Any], as_json: bool) -> dict[str, Any] | None:
    if as_json:
        summary = None
        for line in _lines(remote, body):
            typer.echo(json.dumps(line))
            summary = line.get("summary", summary)
        return summary
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    counts = dict.fromkeys(STATUSES, 0)
    failures: list[dict[str, Any]] = []
    outputs: dict[str, list[str]] = {}  # an output's text -> the devices that gave it, in arrival order
    summary = None
    stream = _lines(remote, body)
    head = next(stream, {})  # a refusal raises here, before any bar is drawn
    total = head.get("fanout", {}).get("total") if isinstance(head.get("fanout"), dict) else None
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(err=True), transient=True) as progress:
        bar = progress.add_task("running", total=total)
        for line in stream:
            if "summary" in line:
                summary = line["summary"]
            elif "device" in line:
                status = line.get("status", "failed")
                counts[status] = counts.get(status, 0) + 1
                if status != "ok":
                    failures.append(line)
                else:
                    outputs.setdefault(output_of(line), []).append(str(line.get("device")))
                progress.update(bar, advance=1, description=_counts(counts))
    if summary is not None:
        _print_outputs(outputs)
        _print_summary(summary, failures)
    return summary


def output_of(line: dict[str, Any]) -> str:
    """The text a successful device's line stands for: each result's stdout (and stderr, labelled), else
    its payload as sorted JSON; two devices with the same text are folded into one block."""
    parts = []
    for result in line.get("results") or []:
        payload = result.get("result")
        if isinstance(payload, dict) and ("stdout" in payload or "stderr" in payload):
            parts.append(str(payload.get("stdout") or ""))
            if payload.get("stderr"):
                parts.append("stderr:\n" + str(payload["stderr"]))
        elif payload is not None:
            parts.append(json.dumps(payload, sort_keys=True, indent=2, default=str))
    return "\n".join(p.rstrip("\n") for p in parts if p)


def fold_header(devices: list[str], width: int) -> str:
    """`ok (3): a1, a2, a3` for a block of devices that gave one output, names cut to `width` columns with
    how many more there are."""
    head = f"ok ({len(devices)}): "
    names = ", ".join(devices)
    if len(head) + len(names) <= width:
        return head + names
    shown: list[str] = []
    for name in devices:
        more = f", … {len(devices) - len(shown) - 1} more"
        if len(head) + len(", ".join([*shown, name])) + len(more) > width:
            break
        shown.append(name)
    return head + ", ".join(shown) + f"{', ' if shown else ''}… {len(devices) - len(shown)} more"


def _print_outputs(outputs: dict[str, list[str]]) -> None:
    from rich.text import Text

    out = console()
    for text, devices in list(outputs.items())[:SHOWN_OUTPUTS]:
        out.print(Text(fold_header(devices, out.width), style="bold green"), soft_wrap=True)
        lines = text.splitlines() or ["(no output)"]
        for line in lines[:OUTPUT_LINES]:
            out.print(Text("  " + line), soft_wrap=True)
        if len(lines) > OUTPUT_LINES:
            out.print(Text(f"  … {len(lines) - OUTPUT_LINES} more lines (--json has them)", style="dim"))
    if len(outputs) > SHOWN_OUTPUTS:
        out.print(Text(f"… and {len(outputs) - SHOWN_OUTPUTS} more distinct outputs (--json lists every device)",
                       style="dim"))


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items() if v or k == "ok")


def _print_summary(summary: dict[str, Any], failures: list[dict[str, Any]]) -> None:
    from rich.table import Table

    out = console()
    table = Table(title=f"{summary.get('total', 0)} device(s) in {summary.get('duration', 0):.2f} s")
    for status in STATUSES:
        table.add_column(status.replace("_", " "), justify="right")
    table.add_row(*(str(summary.get(s, 0)) for s in STATUSES))
    out.print(table)
    for line in failures[:SHOWN_FAILURES]:
        out.print(f"{escape(str(line.get('device')))}: {escape(str(line.get('status')))}: "
                  f"{escape(_error_of(line))}", soft_wrap=True)
    if len(failures) > SHOWN_FAILURES:
        out.print(f"… and {len(failures) - SHOWN_FAILURES} more (--json lists every device)")


def _error_of(line: dict[str, Any]) -> str:
    if line.get("error"):
        return str(line["error"])
    failed = [r for r in line.get("results") or [] if r.get("status") != "success"]
    return str(failed[0].get("error") or failed[0].get("status")) if failed else "no error given"
