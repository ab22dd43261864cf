"""Every fleet figure of issue 13 in one run, one table: each `bench/fleet_*.py` module's `measure()`.

    python -m bench.fleet [--devices N] [--quick] [--only hotpath,storm]

The modules (fleet_hotpath, fleet_storm, fleet_fanout, fleet_devices, fleet_startup — those that exist)
each measure their figures against anchors taken in the same run and return `bench._stats.fleet_row`
rows. Their `measure()` is called with what it accepts of `devices`, `quick` and `repeats`; a module that
fails is reported in the table and the run goes on (the exit status says so at the end).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import pkgutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ORDER = ("hotpath", "fanout", "devices", "startup", "storm")  # known ones first, in this order


def modules() -> list[str]:
    """The `bench.fleet_*` module names present, known ones first."""
    here = Path(__file__).resolve().parent
    found = sorted(m.name.removeprefix("fleet_") for m in pkgutil.iter_modules([str(here)])
                   if m.name.startswith("fleet_"))
    return [n for n in ORDER if n in found] + [n for n in found if n not in ORDER]


def call_measure(measure: Any, devices: int | None, quick: bool) -> list[dict[str, object]]:
    """`measure(...)` with the options its signature names; a required one it names otherwise is an error."""
    offered: dict[str, Any] = {"quick": quick, "repeats": 1 if quick else 5}
    if devices is not None:
        offered["devices"] = devices
    elif "devices" in inspect.signature(measure).parameters and \
            inspect.signature(measure).parameters["devices"].default is inspect.Parameter.empty:
        offered["devices"] = 50 if quick else 1000  # a module with no size of its own (fleet_fanout)
    kwargs: dict[str, Any] = {}
    for name, param in inspect.signature(measure).parameters.items():
        if name in offered:
            kwargs[name] = offered[name]
        elif param.default is inspect.Parameter.empty and param.kind in (param.POSITIONAL_OR_KEYWORD,
                                                                         param.KEYWORD_ONLY):
            raise TypeError(f"measure() needs '{name}', which bench/fleet.py does not know how to give")
    if inspect.iscoroutinefunction(measure):  # fleet_fanout's and fleet_devices' run their own sockets
        import asyncio

        return list(asyncio.run(measure(**kwargs)))
    return list(measure(**kwargs))


def table(rows: list[dict[str, object]]) -> str:
    lines = [f"{'figure':<56} {'measured':>12}  {'anchor':<40} {'ratio':>8}  goal"]
    for row in rows:
        measured = row["measured"]
        shown = f"{measured:.4g} {row['unit']}" if isinstance(measured, float) and not math.isnan(measured) \
            else str(measured)
        anchor = row.get("anchor")
        anchor_text = f"{row['anchor_name']}: {anchor:.4g} {row['unit']}" if isinstance(anchor, float) \
            else str(row.get("anchor_name") or "-")
        ratio = row.get("ratio")
        ratio_text = f"{ratio:.2f}x" if isinstance(ratio, float) and not math.isnan(ratio) else "-"
        lines.append(f"{str(row['figure'])[:56]:<56} {shown:>12}  {anchor_text[:40]:<40} {ratio_text:>8}  "
                     f"{row['goal']}")
    return "\n".join(lines)


def run(devices: int | None, quick: bool, only: list[str] | None = None) -> tuple[list[dict[str, object]], int]:
    rows: list[dict[str, object]] = []
    failed = 0
    for name in modules():
        if only and name not in only:
            continue
        print(f"== bench.fleet_{name}", flush=True)
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.fleet_{name}")
            rows += call_measure(module.measure, devices, quick)
        except Exception as exc:
            failed += 1
            traceback.print_exc()
            rows.append({"figure": f"fleet_{name}: FAILED ({type(exc).__name__}: {exc})"[:120], "measured": "-",
                         "unit": "", "anchor_name": "-", "anchor": None, "ratio": None, "goal": "-"})
        print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=None, help="fleet size for the benches that take one "
                                                                  "(each has its own default)")
    parser.add_argument("--quick", action="store_true", help="the smallest run of each (a smoke test)")
    parser.add_argument("--only", default="", help="comma-separated: " + ", ".join(modules()))
    args = parser.parse_args()
    only = [n.strip().removeprefix("fleet_") for n in args.only.split(",") if n.strip()] or None
    rows, failed = run(args.devices, args.quick, only)
    print()
    print(table(rows))
    if failed:
        sys.exit(f"{failed} fleet benchmark(s) failed")


if __name__ == "__main__":
    main()
