"""`get_system_info`: what this machine is (CPU, memory, disks, network interfaces, OS), read with psutil in a
worker thread so a slow `/proc` or a stuck network mount never blocks the event loop."""

from __future__ import annotations

import asyncio
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any, Literal

import psutil

from tether.tools.runtime import tool

InfoType = Literal["all", "cpu", "memory", "disk", "network", "os"]
_GB = 1024**3


def _gb(n: float) -> float:
    return round(n / _GB, 2)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _cpu_model() -> str:
    """psutil has no CPU model; /proc/cpuinfo does on Linux, `platform` is the portable fallback."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _cpu() -> dict[str, Any]:
    try:
        freq = psutil.cpu_freq()
    except (OSError, RuntimeError, NotImplementedError):
        freq = None
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    return {"model": _cpu_model(), "cores": psutil.cpu_count(logical=False),
            "threads": psutil.cpu_count(logical=True),
            "frequency_mhz": round(freq.current, 1) if freq else None,
            # Usage since the previous call: the first call in a process reports 0.0.
            "percent": psutil.cpu_percent(interval=None), "load_average": load}


def _memory() -> dict[str, Any]:
    mem = psutil.virtual_memory()
    swap = psutil.swap_memory()
    return {"total": mem.total, "available": mem.available, "used": mem.used, "percent": mem.percent,
            "total_gb": _gb(mem.total), "available_gb": _gb(mem.available),
            "swap_total": swap.total, "swap_used": swap.used}


def _disk() -> dict[str, Any]:
    disks: list[dict[str, Any]] = []
    for label, path in (("root", "/"), ("home", str(Path.home()))):
        try:
            usage = shutil.disk_usage(path)
        except OSError as exc:
            disks.append({"label": label, "path": path, "error": str(exc)})
            continue
        disks.append({"label": label, "path": path, "total": usage.total, "used": usage.used,
                      "free": usage.free, "percent": round(usage.used / usage.total * 100, 1) if usage.total else None,
                      "total_gb": _gb(usage.total), "free_gb": _gb(usage.free)})
    return {"disks": disks}


_FAMILIES = {socket.AF_INET: "ipv4", socket.AF_INET6: "ipv6", psutil.AF_LINK: "mac"}


def _network() -> dict[str, Any]:
    stats = psutil.net_if_stats()
    interfaces: dict[str, Any] = {}
    for name, addrs in psutil.net_if_addrs().items():
        st = stats.get(name)
        interfaces[name] = {
            "is_up": st.isup if st else None, "speed_mbps": st.speed if st else None,
            "addresses": [{"family": _FAMILIES.get(a.family, str(a.family)), "address": a.address,
                           "netmask": a.netmask} for a in addrs],
        }
    return {"hostname": socket.gethostname(), "interfaces": interfaces}


def _os() -> dict[str, Any]:
    boot = psutil.boot_time()
    return {"system": platform.system(), "platform": platform.platform(), "release": platform.release(),
            "version": platform.version(), "machine": platform.machine(), "hostname": socket.gethostname(),
            "python": platform.python_version(), "python_executable": sys.executable,
            "boot_time": _iso(boot), "uptime_seconds": round(time.time() - boot)}


_SECTIONS = {"cpu": _cpu, "memory": _memory, "disk": _disk, "network": _network, "os": _os}


@tool(tool_type="data_collection")
async def get_system_info(info_type: InfoType = "all") -> dict[str, Any]:
    """Describe this machine: CPU, memory, disks, network interfaces and OS (one section or all)."""
    names = list(_SECTIONS) if info_type == "all" else [info_type]

    def collect() -> dict[str, Any]:
        return {name: _SECTIONS[name]() for name in names}

    return await asyncio.to_thread(collect)
