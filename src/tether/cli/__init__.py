"""The `tether` command. Sub-commands live in `tether.cli.commands`, one module per command group (in families);
importing one attaches its commands. What they draw on the terminal (and the services' log lines) is in
`tether.cli.views`, the guards around a command (root, the state directory's lock, an uncaught exception) in
`tether.cli.guards`, local mode's task store and question hooks in `tether.cli.local`, the typer-free `tether
exec`/`tether device` path in `tether.cli.fast`, the demos in `tether.cli.demo`. A command module is imported
only when its command runs or shows its help: `tether.cli.lazy.COMMANDS` names every top-level command, the
modules it needs and its help line (add a new command module there)."""

from __future__ import annotations

import sys


def main() -> None:
    """The `tether` command: `tether device` and `tether exec` through `tether.cli.fast` where it parses their
    command line exactly (without typer), everything else through the typer app."""
    if sys.argv[1:] in (["--help"], ["-h"]) and not _typer_env():  # drawn as typer draws it, without typer
        from tether.cli.fast.help import print_root_help

        if print_root_help():
            sys.exit(0)
    if sys.argv[1:2] in (["device"], ["exec"]):  # the commands tether.cli.fast knows (the others never import it)
        from tether.cli.fast import run_fast

        run_fast(sys.argv[1:])  # exits when it ran the command
    from tether.cli.common import app
    from tether.cli.views.rich_help import load_rich_utils

    if len(sys.argv) < 2 or not {"-h", "--help"}.isdisjoint(sys.argv[1:]):
        # typer's help panels without rich's Markdown and tracebacks; a command that runs never
        # draws them (so it does not import typer.rich_utils either), and the output is the same
        load_rich_utils()
    if len(sys.argv) > 1 and sys.argv[1:] not in (["--help"], ["-h"]):  # help alone logs nothing: no `logging`
        import logging

        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except Exception as exc:
        from tether.cli.guards.unhandled import report_unhandled

        report_unhandled(exc)
        raise


def _typer_env() -> bool:
    """Settings only typer reads (`TYPER_USE_RICH`, a shell's completion request): the root help is typer's."""
    import os

    return "TYPER_USE_RICH" in os.environ or any(k.startswith("_") and k.endswith("_COMPLETE") for k in os.environ)
