"""The device profile a device registers with (seed 002's self-checks), and what a task may require."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator

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


HINTS_KEY = "tool_hints"  # {index in `tools`: {"title": ..., "annotations": {...}}} of a dumped profile
HINT_FIELDS = ("title", "annotations")


class DeviceProfile(BaseModel):
    """What a device is and can do; the server stores it and selects devices by it.

    Its tools' `title` and `annotations` (ToolInfo) are dumped beside the tools, as `tool_hints` keyed by the
    tool's index, not inside them: a server of an earlier version keeps that unknown key (extra="allow") and
    validates the tools as it knows them, and a profile of an earlier device simply has none. Validating a
    dumped profile puts them back into its tools."""

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

    @model_validator(mode="before")
    @classmethod
    def _fold_hints(cls, data: Any) -> Any:
        if not isinstance(data, dict) or HINTS_KEY not in data:
            return data
        data = dict(data)
        hints, tools = data.pop(HINTS_KEY), data.get("tools")
        if isinstance(hints, dict) and isinstance(tools, list):
            data["tools"] = [{**tool, **{k: v for k, v in hints.get(str(i), {}).items() if k in HINT_FIELDS}}
                             if isinstance(tool, dict) and isinstance(hints.get(str(i)), dict) else tool
                             for i, tool in enumerate(tools)]
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def tool_hints(self) -> dict[str, dict[str, Any]] | None:
        """The tools' title and annotations by index in `tools` (only the tools that have some), None if none
        has; dumped beside `tools`, read back into them by validation."""
        return {str(i): h for i, tool in enumerate(self.tools) if (h := tool.hints())} or None


class DeviceRequirements(BaseModel):
    """What a batch or task needs of a device; empty means any online device."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    platform: str | None = None
    tags: list[str] = Field(default_factory=list)
    gpu: bool | None = None
    tools: list[str] = Field(default_factory=list)
