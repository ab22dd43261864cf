"""The device profile a device registers with (seed 002's self-checks), and what a task may require."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tether.protocol.models import ToolInfo


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CPUInfo(_Open):
    model: str | None = None
    cores: int | None = None
    threads: int | None = None
    frequency_mhz: float | None = None


class MemoryInfo(_Open):
    total_gb: float | None = None
    available_gb: float | None = None


class DiskInfo(_Open):
    total_gb: float | None = None
    free_gb: float | None = None


class GPUInfo(_Open):
    available: bool = False
    model: str | None = None
    vram_gb: float | None = None


class NetworkInfo(_Open):
    hostname: str | None = None
    addresses: list[str] = Field(default_factory=list)


class OSInfo(_Open):
    platform: str | None = None
    version: str | None = None
    release: str | None = None


class DeviceProfile(BaseModel):
    """What a device is and can do; the server stores it and selects devices by it."""

    model_config = ConfigDict(extra="allow")

    cpu: CPUInfo = Field(default_factory=CPUInfo)
    memory: MemoryInfo = Field(default_factory=MemoryInfo)
    disk: DiskInfo = Field(default_factory=DiskInfo)
    gpu: GPUInfo = Field(default_factory=GPUInfo)
    network: NetworkInfo = Field(default_factory=NetworkInfo)
    os: OSInfo = Field(default_factory=OSInfo)
    installed_apps: list[str] = Field(default_factory=list)
    mcp_servers: list[str] = Field(default_factory=list)
    tools: list[ToolInfo] = Field(default_factory=list)
    tags: list[str] = Field(default_factory=list)
    capabilities: list[str] = Field(default_factory=list)
    home: str | None = Field(None, description="the device user's home directory (plans need real paths)")
    user: str | None = None
    write_roots: list[str] = Field(default_factory=list, description="where the policy lets tools write")
    read_roots: list[str] = Field(default_factory=list, description="where the policy lets tools read")
    sandbox: str | None = Field(None, description="the OS sandbox around the processes the device starts "
                                                  "('bwrap+overlay', …; 'none': unconfined; None: not reported)")
    desktop: dict[str, Any] | None = Field(None, description="the graphical session: backend (x11, xwayland, "
                                                            "wayland or None), the Wayland compositor and what it "
                                                            "offers, and what the desktop tools can do there")


class DeviceRequirements(BaseModel):
    """What a batch or task needs of a device; empty means any online device."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    platform: str | None = None
    tags: list[str] = Field(default_factory=list)
    gpu: bool | None = None
    tools: list[str] = Field(default_factory=list)
