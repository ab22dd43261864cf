"""Run a module under cProfile timed by the process's CPU clock, not the wall clock.

    python -m bench.kit.cpu_profile OUT MODULE [ARGS...]

On a loaded machine a process waits for a core in the middle of anything (a socket `send` that wakes
the peer is often where it is preempted), and a wall-clock profile charges those waits to whatever was
running: here only the CPU the process itself spent counts. The figures are written to OUT (pstats) when
the module returns or exits; the module's own exit status is kept. A server that re-raises the signal it
stopped on once it has shut down (uvicorn does, for SIGTERM) exits instead, so that the figures get written.
"""

from __future__ import annotations

import cProfile
import runpy
import signal
import sys
import time


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out, module = sys.argv[1], sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    def exit_instead(sig: int) -> None:
        raise SystemExit(128 + sig)

    signal.raise_signal = exit_instead  # this process only: its figures are written on the way out
    profiler = cProfile.Profile(time.process_time)
    code: int | str | None = 0
    profiler.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
    finally:
        profiler.disable()
        profiler.dump_stats(out)
    return code if isinstance(code, int) else (0 if code is None else 1)


if __name__ == "__main__":
    sys.exit(main())
