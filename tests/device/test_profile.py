"""`collect_profile`: the self-checks a device registers with, read from this real machine."""

from __future__ import annotations

import platform
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest

from tether.device.local import LocalDevice, build_device
from tether.device.probe import collect_profile, gpu_from_lspci, gpu_from_nvidia_smi, installed_apps
from tether.protocol.profile import DeviceProfile
from tether.tools.policy.model import Policy


@pytest.fixture
async def device(tmp_path: Path) -> AsyncIterator[LocalDevice]:
    dev = build_device(policy=Policy(), state_dir=tmp_path / "state")
    yield dev
    await dev.aclose()


async def test_profile_describes_this_machine_and_its_tools(device: LocalDevice) -> None:
    profile = await collect_profile(device, tags=["lab", "lab", "linux-box"])
    assert profile.cpu.threads == psutil.cpu_count() and profile.cpu.model
    assert profile.cpu.cores is None or 1 <= profile.cpu.cores <= profile.cpu.threads
    assert profile.cpu.frequency_mhz is None or profile.cpu.frequency_mhz > 0
    total = psutil.virtual_memory().total / 1024**3
    assert profile.memory.total_gb == pytest.approx(total, abs=0.01)
    assert 0 < (profile.memory.available_gb or 0) <= profile.memory.total_gb
    assert 0 <= (profile.disk.free_gb or 0) <= (profile.disk.total_gb or 0)
    assert profile.disk.total_gb == pytest.approx(shutil.disk_usage("/").total / 1024**3, abs=0.01)
    assert profile.network.hostname == socket.gethostname()
    assert not any(a.startswith("127.") or a == "::1" for a in profile.network.addresses)
    assert profile.os.platform == platform.system().lower() and profile.os.release == platform.release()
    assert profile.tags == ["lab", "linux-box"]
    # the optional sets (desktop, browser) appear only where they can run
    assert {"files", "shell", "system"} <= set(profile.mcp_servers)
    assert set(profile.mcp_servers) <= {"files", "shell", "system", "transfer", "desktop", "browser"}
    assert profile.capabilities[:3] == ["shell", "files", "system"]
    names = {t.name for t in profile.tools}
    assert {"shell.run", "get_system_info"} <= names and "list_tools" not in names  # meta tools are implied
    if profile.gpu.available:
        assert profile.gpu.model and "gpu" in profile.capabilities
    else:
        assert profile.gpu.model is None and "gpu" not in profile.capabilities
    assert "git" in profile.installed_apps  # the test suite itself needs git
    assert profile.desktop is not None and profile.desktop["backend"] in ("x11", "xwayland", "wayland", None)
    # what the server receives survives the wire
    assert DeviceProfile.model_validate_json(profile.model_dump_json()) == profile


def test_installed_apps_reads_desktop_entries_and_path(tmp_path: Path) -> None:
    apps = tmp_path / "applications"
    apps.mkdir()
    (apps / "editor.desktop").write_text("[Desktop Entry]\nType=Application\nName=Text Editor\nExec=edit\n")
    (apps / "hidden.desktop").write_text("[Desktop Entry]\nType=Application\nName=Helper\nNoDisplay=true\n")
    (apps / "link.desktop").write_text("[Desktop Entry]\nType=Link\nName=Website\n")
    (apps / "broken.desktop").write_text("not an ini file at all\n")
    found = installed_apps([apps, tmp_path / "missing"], programs=("git", "no-such-program-here"))
    assert found == ["git", "Text Editor"]


def test_gpu_parsers() -> None:
    smi = "NVIDIA GeForce RTX 4090, 24564\nNVIDIA GeForce RTX 4090, 24564\n"
    gpu = gpu_from_nvidia_smi(smi)
    assert gpu is not None and gpu.available and gpu.model == "NVIDIA GeForce RTX 4090" and gpu.vram_gb == 24.0
    assert gpu.model_extra == {"count": 2}
    lspci = ("00:01.0 VGA compatible controller: Red Hat, Inc. Virtio GPU (rev 01)\n"
             "01:00.0 3D controller: NVIDIA Corporation GA100 [A100 PCIe 40GB] (rev a1)\n")
    found = gpu_from_lspci(lspci)
    assert found is not None and found.model == "NVIDIA Corporation GA100 [A100 PCIe 40GB] (rev a1)"
    assert gpu_from_lspci("00:02.0 VGA compatible controller: Cirrus Logic GD 5446\n") is None
    assert gpu_from_nvidia_smi("") is None
