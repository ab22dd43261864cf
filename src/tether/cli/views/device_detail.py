"""`tether devices NAME`: one device's profile as label/value lines that fit the terminal (values fold)."""

from __future__ import annotations

import time
from typing import Any

from rich.markup import escape
from rich.table import Table


def _ago(stamp: float | None, now: float) -> str:
    if not stamp:
        return "-"
    seconds = max(now - stamp, 0)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def detail_lines(device: dict[str, Any], key: dict[str, Any] | None, now: float | None = None) -> list[tuple[str, str]]:
    """(label, plain text) for each line of the view of `device` (a `GET /api/v1/devices/{name}` body)
    and `key` (a `GET /api/v1/devices/{name}/key` body, None when it could not be read)."""
    now = time.time() if now is None else now
    profile = device.get("profile") or {}
    os_info, cpu, memory = profile.get("os") or {}, profile.get("cpu") or {}, profile.get("memory") or {}
    gpu = profile.get("gpu") or {}
    platform = " ".join(str(p) for p in (os_info.get("platform") or device.get("platform"), os_info.get("release"))
                        if p) or "-"
    cores = cpu.get("cores")
    cpu_text = ", ".join(p for p in (cpu.get("model"), f"{cores} cores" if cores else None) if p) or "-"
    total, free = memory.get("total_gb"), memory.get("available_gb")
    memory_text = (f"{total:g} GB" + (f" ({free:g} GB free)" if free is not None else "")) if total else "-"
    fingerprint = (key or {}).get("fingerprint")
    lines = [("name", device["name"]), ("status", device.get("status") or "-"),
             ("last seen", _ago(device.get("last_seen"), now)), ("platform", platform), ("cpu", cpu_text),
             ("memory", memory_text), ("gpu", (gpu.get("model") or "yes") if gpu.get("available") else "no"),
             ("tools", str(len(profile.get("tools") or []))),
             ("tags", ", ".join(device.get("tags") or []) or "-"),
             ("sandbox", device.get("sandbox") or "-"),
             ("capabilities", ", ".join(device.get("capabilities") or []) or "-")]
    if device.get("node"):
        lines.append(("node", device["node"]))
    if device.get("address"):
        lines.append(("address", device["address"]))
    lines.append(("key", fingerprint or ("none enrolled" if key is not None else "-")))
    if fingerprint and key is not None:
        lines.append(("enrolled", f"{_ago(key.get('enrolled_at'), now)} by {key.get('enrolled_by') or '?'}"))
    return lines


def detail_grid(lines: list[tuple[str, str]]) -> Table:
    """The lines as a two-column grid: labels never cut, values folded onto more lines when long (a
    64-character key fingerprint in an 80-column terminal)."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    for label, value in lines:
        grid.add_row(label, escape(value))
    return grid
