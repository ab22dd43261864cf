"""`tether demo`: server and device as separate processes on loopback (or `--local`: one process)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tether.cli.common import StateOpt, app, console, run_async


@app.command()
def demo(local: Annotated[bool, typer.Option("--local", help="one process, no server")] = False,
         state_dir: StateOpt = None) -> None:
    """Run a short demo that needs no LLM key: a server, a device, and commands through them."""
    if local:
        from tether.cli.demo.tour import run_demo

        raise typer.Exit(run_async(run_demo(console(), state_dir)))
    from tether.cli.demo.networked import run_remote_demo

    raise typer.Exit(run_remote_demo(console(), Path(state_dir) if state_dir else None))
