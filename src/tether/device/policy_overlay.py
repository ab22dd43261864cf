"""`RemotePolicy`: the device's end of `tether policy` — applies a server's change, persists it, reports.

The server's overlay (see `tether.tools.policy.overlay`) is kept in `remote-policy.json` in the
device's state directory (mode 0600, written to a temporary file and renamed, so a crash leaves the
old or the new one), with a version that counts the changes. The device's `Policy` object is shared
by every tool context, so a change is applied by updating that one object in place: the next check
anywhere sees it. A device whose own policy says `policy_remote: false` refuses every change and
ignores an overlay stored before.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tether.errors import DeviceError
from tether.tools.policy.model import Policy
from tether.tools.policy.overlay import check_overlay, effective, merged, sources

logger = logging.getLogger(__name__)

FILE_NAME = "remote-policy.json"
MAX_FILE_BYTES = 1 << 20


class PolicyChangeRefused(DeviceError, ValueError):
    """The device does not take policy changes from its server."""


class RemotePolicy:
    def __init__(self, live: Policy, state_dir: str | os.PathLike[str],
                 on_change: Callable[[Policy], None] | None = None) -> None:
        self.live = live  # the object the tools hold: changed in place
        self.base = live.model_copy(deep=True)  # the device's own policy (defaults + its file)
        self.path = Path(state_dir) / FILE_NAME
        self.on_change = on_change
        self.version = 0
        self.overlay: dict[str, Any] = {}

    @property
    def allowed(self) -> bool:
        return self.base.policy_remote

    def load(self) -> None:
        """Apply the overlay stored by an earlier run; ValueError (saying which file) if it is unusable."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ValueError(f"{self.path}: cannot read: {exc.strerror or exc}") from None
        try:
            if len(raw) > MAX_FILE_BYTES:
                raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
            data = json.loads(raw)
            version, overlay = int(data["version"]), check_overlay(data["overlay"])
            policy = effective(self.base, overlay)
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{self.path}: not a usable remote policy ({exc}); remove it to start from the "
                             "device's own policy") from None
        self.version = version
        if not self.allowed:
            logger.warning("%s is ignored: this device's policy says policy_remote: false", self.path)
            return
        self.overlay = overlay
        self._install(policy)

    def report(self) -> dict[str, Any]:
        return {"version": self.version, "policy": self.live.model_dump(mode="json"),
                "sources": sources(self.base, self.overlay), "remote_allowed": self.allowed}

    def apply(self, change: Mapping[str, Any], *, replace: bool = False) -> dict[str, Any]:
        """Apply a server's change (the whole overlay with `replace`), persist it, return the new report.
        Nothing changes when it is refused or invalid (PolicyChangeRefused / ValueError)."""
        if not self.allowed:
            raise PolicyChangeRefused("this device refuses remote policy changes (policy_remote: false in its own "
                                      "policy)")
        checked = check_overlay(change)
        for name, rule in (checked.get("commands") or {}).items():
            if rule == {"approve": True} and name in self.live.commands:  # keep its argument rules
                checked["commands"][name] = {**self.live.commands[name].model_dump(), "approve": True}
        overlay = checked if replace else merged(self.overlay, checked)
        policy = effective(self.base, overlay)
        self._save(self.version + 1, overlay)
        self.version += 1
        self.overlay = overlay
        self._install(policy)
        logger.info("policy version %d applied (changed: %s)", self.version, ", ".join(sorted(checked)) or "nothing")
        return self.report()

    def _save(self, version: int, overlay: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump({"version": version, "overlay": overlay}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.path)

    def _install(self, policy: Policy) -> None:
        for name in Policy.model_fields:
            setattr(self.live, name, getattr(policy, name))
        if self.on_change is not None:
            self.on_change(self.live)
