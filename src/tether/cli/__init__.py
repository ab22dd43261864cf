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
        from tether.remote import RemoteError
        from tether.server.store import StoreUnavailable  # only now: the CLI imports lazily

        if isinstance(exc, RemoteError):  # a command that did not catch it: the same words and code as those that do
            from tether.cli.common import ExitCode, remote_message

            print(f"error: {remote_message(exc)}", file=sys.stderr)
            sys.exit(ExitCode.UNREACHABLE if exc.status is None else ExitCode.USAGE if exc.status == 401
                     else ExitCode.FAILED)
        if not isinstance(exc, StoreUnavailable):
            raise
        # a full or read-only disk under the state directory: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
