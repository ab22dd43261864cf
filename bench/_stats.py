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
