"""Percentiles and a uniform way to print benchmark lines."""

from __future__ import annotations

import statistics


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(name: str, samples_s: list[float]) -> dict[str, float]:
    us = [s * 1e6 for s in samples_s]
    row = {"p50_us": pct(us, 50), "p99_us": pct(us, 99), "mean_us": statistics.fmean(us), "n": len(us)}
    print(f"{name:<48} p50 {row['p50_us']:9.1f} us   p99 {row['p99_us']:9.1f} us   n={len(us)}")
    return row


def spread(samples: list[float]) -> str:
    """min-max of repeated medians, the way every fleet row reports its noise."""
    return f"{min(samples):.3g}..{max(samples):.3g}"


def fleet_row(figure: str, measured: float, unit: str, anchor_name: str, anchor: float | None,
              goal: str, note: str = "") -> dict[str, object]:
    """One row of `bench/fleet.py`'s table: the figure, its anchor in the same run, ratio and goal.

    Each `bench/fleet_*.py` module returns a list of these from `measure(...)`, so `bench/fleet.py`
    can run them all in one process and print one table.
    """
    ratio = (measured / anchor) if anchor else None
    row = {"figure": figure, "measured": measured, "unit": unit, "anchor_name": anchor_name,
           "anchor": anchor, "ratio": ratio, "goal": goal, "note": note}
    shown_ratio = f"{ratio:8.2f}x" if ratio is not None else "        -"
    shown_anchor = f"{anchor:.4g} {unit}" if anchor is not None else "-"
    print(f"{figure:<52} {measured:10.4g} {unit:<6} anchor {anchor_name}: {shown_anchor:<14} "
          f"{shown_ratio}  goal {goal}  {note}")
    return row
