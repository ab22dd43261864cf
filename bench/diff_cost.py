"""What a changed file's diff costs the device, against what its apply already pays for the same file.

For three edits — a 100 KiB config with one line changed, a 1 MiB log (20,000 lines) with one line changed,
and a 1 MiB file rewritten whole (every line different: difflib's bad case) — it times
`layers.diff.layer_diffs` (read both sides, diff, cap) against its anchor measured in the same run,
interleaved: `UndoJournal.record` of the same file (the copy of the old content every overwrite journals
before it is applied). Prints per case the medians of repeated rounds, their spread and the ratio.

    python -m bench.diff_cost [--rounds 7] [--reps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench._stats import spread
from tether.sandbox.layers.diff import layer_diffs
from tether.sandbox.layers.layer import Change
from tether.tools.journal import UndoJournal


def _case(base: Path, name: str, old: bytes, new: bytes) -> tuple[Change, Path]:
    real, upper = base / "real", base / "upper"
    real.mkdir(parents=True, exist_ok=True)
    upper.mkdir(parents=True, exist_ok=True)
    (real / name).write_bytes(old)
    (upper / name).write_bytes(new)
    st = os.lstat(real / name)
    return Change(str(real / name), "modified", len(new), "file", str(real), source=str(upper / name),
                  was=(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)), real / name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    config = "".join(f"option_{i} = value {i}\n" for i in range(4000)).encode()  # ~100 KiB
    log = "".join(f"2026-11-27 12:00:{i % 60:02d} request {i} served in {i % 97} ms\n" for i in range(20_000))
    log_b = log.encode()[: 1 << 20]
    cases = {
        "100 KiB config, one line": (config, config.replace(b"value 2000\n", b"value two thousand\n")),
        "1 MiB log, one line": (log_b, log_b.replace(b"request 10000 ", b"request ten-thousand ")),
        "1 MiB rewritten whole": (log_b, log_b.replace(b"request", b"answer")),
    }
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; rounds {args.rounds} x reps {args.reps}")
    with tempfile.TemporaryDirectory() as tmp:
        journal = UndoJournal(Path(tmp) / "state")
        for label, (old, new) in cases.items():
            change, real = _case(Path(tmp) / label.replace(" ", "_"), "f.txt", old, new)
            diffs_med, anchor_med = [], []
            for _ in range(args.rounds):
                d, a = [], []
                for _ in range(args.reps):  # interleaved: a diff, then the journal copy of the same file
                    t = time.perf_counter()
                    record = layer_diffs([change])[0]
                    d.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    journal.record("bench", "write", real)
                    a.append(time.perf_counter() - t)
                diffs_med.append(statistics.median(d) * 1e3)
                anchor_med.append(statistics.median(a) * 1e3)
            dm, am = statistics.median(diffs_med), statistics.median(anchor_med)
            shown = f"{len(record.get('diff', ''))} B diff" + (" (cut)" if record.get("diff_truncated") else "")
            print(f"{label:<28} diff {dm:8.2f} ms ({spread(diffs_med)})   anchor journal copy {am:7.2f} ms "
                  f"({spread(anchor_med)})   ratio {dm / am:6.2f}x   {shown}")


if __name__ == "__main__":
    main()
