"""The device's self-checks (seed 002): what this machine is and what it can do, for registration.

The server selects devices by this profile (platform, tags, GPU, tools), so it reports facts, not
guesses: a GPU is "available" only when something on the machine names one, and a value that cannot
be read is None rather than a default. It runs once per registration (not per command): the file
and psutil reads go to one worker thread, and the probes that start programs (`nvidia-smi`,
`lspci`) run from argv lists with a short timeout, their process group killed if they hang.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import getpass
import ipaddress
import logging
import os
import platform
import shutil
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from tether.device.local import LocalDevice
from tether.protocol.models import ToolInfo
from tether.protocol.profile import (
    CPUInfo,
    DeviceProfile,
    DiskInfo,
    GPUInfo,
    MemoryInfo,
    NetworkInfo,
    OSInfo,
)
from tether.tools.running.process import run_process
from tether.tools.system.info import _cpu_model

logger = logging.getLogger(__name__)

_GB = 1024**3
PROBE_TIMEOUT_S = 3.0
# Programs worth telling a planner about when they are on PATH (desktop entries cover GUI apps).
KNOWN_PROGRAMS = ("git", "python3", "node", "npm", "docker", "podman", "kubectl", "java", "go", "cargo", "gcc",
                  "make", "cmake", "curl", "wget", "ffmpeg", "chromium", "chromium-browser", "google-chrome",
                  "firefox", "code", "libreoffice", "gimp", "xdotool", "Xvfb", "tesseract", "psql", "sqlite3")
CAPABILITY_NAMESPACES = ("shell", "files", "system", "desktop", "browser")
# Display adapters of virtual machines and server management chips: a screen, not a GPU.
_NOT_A_GPU = ("qemu", "bochs", "cirrus", "vmware svga", "virtualbox", "red hat", "virtio", "aspeed", "matrox",
              "hyper-v", "microsoft corporation basic")
_APP_DIRS = (Path("/usr/share/applications"), Path("/usr/local/share/applications"),
             Path("/var/lib/flatpak/exports/share/applications"), Path("/var/lib/snapd/desktop/applications"))


def _gb(n: float) -> float:
    return round(n / _GB, 2)


def _cpu() -> CPUInfo:
    try:
        freq = psutil.cpu_freq()
    except (OSError, RuntimeError, NotImplementedError):
        freq = None
    return CPUInfo(model=_cpu_model(), cores=psutil.cpu_count(logical=False), threads=psutil.cpu_count(logical=True),
                   frequency_mhz=round(freq.current, 1) if freq and freq.current else None)


def _memory() -> MemoryInfo:
    mem = psutil.virtual_memory()
    return MemoryInfo(total_gb=_gb(mem.total), available_gb=_gb(mem.available))


def _disk(path: str = "/") -> DiskInfo:
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return DiskInfo(path=path)
    return DiskInfo(total_gb=_gb(usage.total), free_gb=_gb(usage.free), path=path)


def _network() -> NetworkInfo:
    """Host name and the addresses others could reach this machine on (no loopback, no link-local)."""
    addresses: list[str] = []
    for addrs in psutil.net_if_addrs().items():
        for addr in addrs[1]:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            text = addr.address.split("%", 1)[0]
            try:
                ip = ipaddress.ip_address(text)
            except ValueError:
                continue
            if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified) and text not in addresses:
                addresses.append(text)
    return NetworkInfo(hostname=socket.gethostname(), addresses=addresses)


def _os() -> OSInfo:
    """`platform` is what DeviceRequirements.platform matches (`linux`, `darwin`, `windows`)."""
    extra: dict[str, Any] = {"machine": platform.machine()}
    version = platform.version()
    with contextlib.suppress(OSError, AttributeError):
        release = platform.freedesktop_os_release()
        extra["distribution"] = release.get("PRETTY_NAME") or release.get("NAME")
        version = release.get("VERSION_ID") or version
    return OSInfo(platform=platform.system().lower(), version=version, release=platform.release(), **extra)


def _desktop_name(path: Path) -> str | None:
    """The `Name=` of a desktop entry that a user would see in a menu, else None."""
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(path, encoding="utf-8")
        entry = parser["Desktop Entry"]
    except (configparser.Error, KeyError, OSError, UnicodeDecodeError):
        return None
    if entry.get("NoDisplay", "").lower() == "true" or entry.get("Hidden", "").lower() == "true":
        return None
    if entry.get("Type", "Application") != "Application":
        return None
    return entry.get("Name") or path.stem


def installed_apps(app_dirs: Sequence[Path] | None = None, programs: Sequence[str] = KNOWN_PROGRAMS) -> list[str]:
    """Desktop applications (by their menu name) and well-known programs found on PATH."""
    dirs = list(app_dirs) if app_dirs is not None else [*_APP_DIRS, Path.home() / ".local/share/applications"]
    names: set[str] = set()
    for directory in dirs:
        with contextlib.suppress(OSError):
            for path in directory.glob("*.desktop"):
                name = _desktop_name(path)
                if name:
                    names.add(name)
    names.update(p for p in programs if shutil.which(p))
    return sorted(names, key=str.lower)


def _host_facts() -> dict[str, Any]:
    """Everything that reads files or /proc: one trip to a worker thread."""
    from tether.tools.desktop.wayland import session_facts

    return {"cpu": _cpu(), "memory": _memory(), "disk": _disk("/"), "network": _network(), "os": _os(),
            "installed_apps": installed_apps(), "desktop": session_facts()}


async def _probe(argv: list[str]) -> str | None:
    """stdout of a short-lived probe program, or None if it is missing, fails or hangs."""
    program = shutil.which(argv[0])
    if program is None:
        return None
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            result = await run_process(argv, executable=program, cwd="/", env=None, stdin=None, max_output=256 * 1024)
    except (OSError, TimeoutError) as exc:
        logger.info("probe %s failed: %s", argv[0], exc)
        return None
    return result.stdout.decode("utf-8", "replace") if result.exit_code == 0 else None


def gpu_from_lspci(text: str) -> GPUInfo | None:
    """The first display controller in `lspci` output that is a GPU (not a VM's or a BMC's screen)."""
    for line in text.splitlines():
        _, _, rest = line.partition(" ")
        kind, sep, model = rest.partition(": ")
        if not sep or not any(k in kind for k in ("VGA compatible controller", "3D controller", "Display controller")):
            continue
        if any(v in model.lower() for v in _NOT_A_GPU):
            continue
        return GPUInfo(available=True, model=model.strip() or None)
    return None


def gpu_from_nvidia_smi(text: str) -> GPUInfo | None:
    """Parse `nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`."""
    first = next((line for line in text.splitlines() if line.strip()), None)
    if first is None:
        return None
    name, _, mib = first.partition(",")
    vram: float | None = None
    with contextlib.suppress(ValueError):
        vram = round(float(mib.strip()) / 1024, 1)
    count = sum(1 for line in text.splitlines() if line.strip())
    return GPUInfo(available=True, model=name.strip() or None, vram_gb=vram, count=count)


def _gpu_from_proc(root: Path = Path("/proc/driver/nvidia/gpus")) -> GPUInfo | None:
    with contextlib.suppress(OSError):
        for info in sorted(root.glob("*/information")):
            for line in info.read_text(errors="replace").splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "Model" and value.strip():
                    return GPUInfo(available=True, model=value.strip())
    return None


async def detect_gpu() -> GPUInfo:
    """nvidia-smi, then the NVIDIA driver's /proc files, then lspci; nothing found → not available."""
    text = await _probe(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    found = gpu_from_nvidia_smi(text) if text else None
    if found is None:
        found = await asyncio.to_thread(_gpu_from_proc)
    if found is None:
        text = await _probe(["lspci"])
        found = gpu_from_lspci(text) if text else None
    return found or GPUInfo(available=False, model=None)


async def collect_profile(device: LocalDevice, *, tags: Sequence[str] = (),
                          sandbox: str | None = None) -> DeviceProfile:
    """The profile this device registers with: hardware, OS, apps, the default computer's tools, and
    `sandbox`, the kind `tether.sandbox.detect()` found when the device started (detected once, not per
    registration: it costs a probe process)."""
    computer = await device.computer_manager.get_or_create(None)
    tools: list[ToolInfo] = computer.tool_infos()
    facts, gpu = await asyncio.gather(asyncio.to_thread(_host_facts), detect_gpu())
    namespaces = sorted({t.namespace for t in tools})
    capabilities = [ns for ns in CAPABILITY_NAMESPACES if ns in namespaces]
    if gpu.available:
        capabilities.append("gpu")
    return DeviceProfile(**facts, gpu=gpu, mcp_servers=namespaces, tools=tools, tags=list(dict.fromkeys(tags)),
                         capabilities=capabilities, sandbox=sandbox,
                         **_user_facts(device.policy.write_roots, device.policy.read_roots))


def _user_facts(write_roots: Sequence[str], read_roots: Sequence[str]) -> dict[str, Any]:
    """Who the device acts as and where it may write: a planner needs real paths for "my home"."""
    return {"home": os.path.expanduser("~"), "user": getpass.getuser(),
            "write_roots": [os.path.expanduser(r) for r in write_roots],
            "read_roots": [os.path.expanduser(r) for r in read_roots]}
