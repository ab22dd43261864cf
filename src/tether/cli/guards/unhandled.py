"""What the `tether` command does with an exception no command caught (its typer path and `tether.cli.fast`)."""

from __future__ import annotations

import sys


def report_unhandled(exc: Exception) -> None:
    """An exception no command caught: a server's refusal (`RemoteError`), a state directory that cannot be
    written (`StoreUnavailable`) or that another process holds (`StateDirBusy`), or an argument that is not UTF-8
    text where it had to be sent as such (`UnicodeEncodeError` of a surrogate escape) is said in one line on stderr
    and exits (with the code a command gives it). Any other is a bug in tether: one line naming it, exit code 1,
    and no traceback for the user — unless TETHER_DEBUG is set (to anything but "" or "0"), when this returns
    and the caller re-raises it, traceback and all."""
    from tether.cli.views.safe_text import visible
    from tether.client.rest import RemoteError
    from tether.device.local import StateDirBusy
    from tether.server.store import StoreUnavailable  # only now: the CLI imports lazily

    if isinstance(exc, RemoteError):  # a command that did not catch it: the same words and code as those that do
        from tether.cli.common import remote_exit_code, remote_message

        print(f"error: {visible(remote_message(exc))}", file=sys.stderr)
        sys.exit(remote_exit_code(exc))
    # a state directory another process holds (a command that did not take the lock first: `tether demo --local`)
    # or a full or read-only disk under it: one line, no traceback
    if isinstance(exc, StateDirBusy | StoreUnavailable):
        print(f"error: {visible(exc)}", file=sys.stderr)
        sys.exit(2)
    if isinstance(exc, UnicodeEncodeError) and exc.reason == "surrogates not allowed":
        # an argument in another encoding (Python keeps its bytes as surrogate escapes) that had to be sent as
        # UTF-8 text (a JSON body, a header): one line naming the bytes, exit 2 as any usage error
        bad = str(exc.object[exc.start:exc.end]).encode("utf-8", "surrogateescape")
        print(f"error: an argument is not UTF-8 text (bytes {bad!r}); tether sends text as UTF-8", file=sys.stderr)
        sys.exit(2)
    import os

    if os.environ.get("TETHER_DEBUG", "") not in ("", "0"):
        return
    what = visible(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, one_line=True)[:500]
    print(f"error: tether stopped on an unexpected error ({what}); this is a bug in tether: run the command again "
          "with TETHER_DEBUG=1 to see where it happened, and report it", file=sys.stderr)
    sys.exit(1)
