"""`tether cp DEVICE:PATH DEVICE:PATH`: a file or directory from one device to another (docs/transfer.md)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape

from tether.cli.common import CaOpt, ExitCode, JsonOpt, ServerOpt, TokenOpt, app, console, fail, fail_remote


def split_place(text: str, which: str) -> tuple[str, str]:
    """`DEVICE:PATH` as (device, path); a usage error (exit 2) naming `which` argument otherwise."""
    device, sep, path = text.partition(":")
    if not sep or not device or not path:
        fail(f"{which} {text!r}: write it as DEVICE:PATH (e.g. laptop:~/build/out)")
    return device, path


@app.command("cp", rich_help_panel="Fleet")
def cp(source: Annotated[str, typer.Argument(help="DEVICE:PATH of the file or directory to send")],
       dest: Annotated[str, typer.Argument(help="DEVICE:PATH where it goes (an existing directory receives it "
                                               "by its name)")],
       overwrite: Annotated[bool, typer.Option("--overwrite", help="replace existing files (outside the "
                                               "receiver's temp dir a person approves)")] = False,
       approve: Annotated[bool, typer.Option("--approve", help="approve what the receiver reserves for a person "
                                             "(a person's token with the approve scope)")] = False,
       digest: Annotated[str | None, typer.Option("--digest", help="the approval digest the refusal "
                                                   "showed, to approve exactly that")] = None,
       max_bytes: Annotated[int | None, typer.Option("--max-bytes", min=1, help="refuse more file data than "
                                                     "this (the server's cap applies too)")] = None,
       chunk_bytes: Annotated[int | None, typer.Option("--chunk-bytes", min=4096, help="bytes per chunk")] = None,
       session: Annotated[str | None, typer.Option("--session", help="the receiver's undo session (default: "
                                                   "your token's)")] = None,
       server: ServerOpt = None, token: TokenOpt = None, ca_file: CaOpt = None, as_json: JsonOpt = False) -> None:
    """Send a file or directory from one device to another through the server: streamed in chunks, its
    sha256 checked on the receiver before it appears, resumed if a device reconnects, written under the
    receiver's policy (approvals, undo journal).

    Exit 1 when the transfer fails, 3 when the receiver holds it for a person's approval."""
    from tether.client.rest import RemoteError, RemoteServer

    src_device, src_path = split_place(source, "SOURCE")
    dst_device, dst_path = split_place(dest, "DEST")
    body: dict[str, Any] = {"source": src_device, "source_path": src_path, "dest": dst_device, "dest_path": dst_path,
                            "overwrite": overwrite, "approve": approve, "approval_digest": digest,
                            "max_bytes": max_bytes, "chunk_bytes": chunk_bytes, "session_id": session}
    try:
        with RemoteServer(server, token, ca_file=ca_file) as remote:
            result = remote.transfer({k: v for k, v in body.items() if v is not None})
    except RemoteError as exc:
        fail_remote(exc)
    if as_json:
        typer.echo(json.dumps(result.model_dump(mode="json"), indent=2))
    elif result.ok:
        r = result.result
        resumed = f", {r['resumes']} resume(s)" if r["resumes"] else ""
        console().print(f"sent {r['files']} file(s), {r['bytes']} bytes, to {escape(r['dest'])}:"
                        f"{escape(r['root'])} in {r['seconds']} s{resumed}; sha256 {r['sha256']} verified")
    else:
        console().print(f"[red]transfer failed:[/red] {escape(result.error or 'no reason given')}", soft_wrap=True)
        payload = result.result if isinstance(result.result, dict) else {}
        if payload.get("needs_approval"):
            console().print(f"a person approves it with: tether cp {escape(source)} {escape(dest)} --approve "
                            f"--digest {payload.get('approval_digest', '')}")
    if not result.ok:
        held = isinstance(result.result, dict) and result.result.get("needs_approval")
        raise typer.Exit(ExitCode.WAITING if held else ExitCode.FAILED)
