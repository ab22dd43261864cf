"""The `tether` command. Sub-commands live in modules by topic; importing them attaches them."""

from __future__ import annotations

import logging
import sys


def main() -> None:
    from tether.cli import (  # noqa: F401
        audit_cmds,
        demo_cmds,
        journal_cmds,
        pairing_cmds,
        policy_cmds,
        run_cmds,
        server_cmds,
        service_cmds,
        task_cmds,
        tools_cmds,
    )
    from tether.cli.common import app

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        app()
    except Exception as exc:
        from tether.server.store import StoreUnavailable  # only now: the CLI imports lazily

        if not isinstance(exc, StoreUnavailable):
            raise
        # a full or read-only disk under the state directory: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
