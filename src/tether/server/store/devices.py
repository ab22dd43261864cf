"""The `devices` table (each device the server has seen, its profile and tool list kept once per
content) and the `device_keys` table (which Ed25519 key each device is)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tether.server.store.engine import Engine
from tether.server.store.tokens import Tokens


class StoredDevice(BaseModel):
    name: str
    profile: dict[str, Any] | None
    first_seen: float
    last_seen: float


class Devices:
    """The `devices` and `device_tools` tables of a `Store` (`store.devices`)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._conn, self._lock, self._writing = engine.conn, engine.lock, engine.writing

    def upsert(self, name: str, profile_json: str | None, last_seen: float, *,
                      tools: tuple[str, str | bytes] | None = None) -> None:
        """Remember a device; `profile_json=None` keeps the profile already stored. `tools` is (digest,
        JSON) of a tool list kept apart from `profile_json` (which then holds no `tools`), once per digest."""
        with self._writing(), self._lock:
            if tools is not None:
                self._conn.execute("INSERT OR IGNORE INTO device_tools (digest, tools) VALUES (?, ?)",
                                   (tools[0], tools[1].decode() if isinstance(tools[1], bytes) else tools[1]))
            self._conn.execute(
                "INSERT INTO devices (name, profile, first_seen, last_seen, tools_digest, platform, tags) "
                "VALUES (:name, :profile, :seen, :seen, :digest, json_extract(:profile, '$.os.platform'), "
                "json_extract(:profile, '$.tags')) "
                "ON CONFLICT (name) DO UPDATE SET profile = COALESCE(excluded.profile, devices.profile), "
                "tools_digest = CASE WHEN excluded.profile IS NULL THEN devices.tools_digest "
                "ELSE excluded.tools_digest END, "
                "platform = CASE WHEN excluded.profile IS NULL THEN devices.platform ELSE excluded.platform END, "
                "tags = CASE WHEN excluded.profile IS NULL THEN devices.tags ELSE excluded.tags END, "
                "last_seen = excluded.last_seen",
                {"name": name, "profile": profile_json, "seen": last_seen, "digest": tools[0] if tools else None})

    def all(self) -> list[StoredDevice]:
        """Every known device with its whole profile (tools put back): for tools and tests, not start-up."""
        with self._lock:
            rows = self._conn.execute("SELECT d.*, t.tools AS tool_list FROM devices d LEFT JOIN device_tools t "
                                      "ON t.digest = d.tools_digest ORDER BY d.name").fetchall()
        devices = []
        for r in rows:
            profile = json.loads(r["profile"]) if r["profile"] else None
            if profile is not None and r["tool_list"] is not None:
                profile["tools"] = json.loads(r["tool_list"])
            devices.append(StoredDevice(name=r["name"], profile=profile, first_seen=r["first_seen"],
                                        last_seen=r["last_seen"]))
        return devices

    def heads(self) -> list[tuple[str, float, str | None, list[str], bool]]:
        """(name, last_seen, platform, tags, has a profile) of every known device: what start-up lists
        without reading a single profile."""
        with self._lock:
            rows = self._conn.execute("SELECT name, last_seen, platform, COALESCE(admin_tags, tags), "
                                      "profile IS NOT NULL FROM devices ORDER BY name").fetchall()
        heads = []
        for name, last_seen, platform, tags, stored in rows:
            try:
                tag_list = json.loads(tags) if tags else []
            except ValueError:
                tag_list = []
            if not isinstance(tag_list, list):
                tag_list = []
            heads.append((name, last_seen, platform if isinstance(platform, str) else None,
                          [t for t in tag_list if isinstance(t, str)], bool(stored)))
        return heads

    def profile(self, name: str) -> tuple[str, str | None, str | None] | None:
        """A device's stored profile as (profile JSON, tools digest, tools JSON), or None."""
        with self._lock:
            row = self._conn.execute("SELECT d.profile, d.tools_digest, t.tools FROM devices d LEFT JOIN "
                                     "device_tools t ON t.digest = d.tools_digest WHERE d.name = ?",
                                     (name,)).fetchone()
        if row is None or row[0] is None:
            return None
        return row[0], row[1] if row[2] is not None else None, row[2]

    def forget(self, name: str) -> bool:
        """Delete device `name`'s row (its tool list stays, shared by digest); whether it had one."""
        with self._writing(), self._lock:
            return self._conn.execute("DELETE FROM devices WHERE name = ?", (name,)).rowcount > 0

    def tag_overrides(self) -> dict[str, list[str]]:
        """The tags an admin set, by device (`set_tags`): they stand for the tags the device reports."""
        rows = self._engine.read("SELECT name, admin_tags FROM devices WHERE admin_tags IS NOT NULL")
        return {name: [t for t in json.loads(tags) if isinstance(t, str)] for name, tags in rows}

    def set_tags(self, name: str, tags: list[str], last_seen: float) -> None:
        """Set device `name`'s tags (kept over the ones it reports); a device without a row gets one."""
        with self._writing(), self._lock:
            self._conn.execute(
                "INSERT INTO devices (name, profile, first_seen, last_seen, admin_tags, tags) "
                "VALUES (?, NULL, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET admin_tags = excluded.admin_tags",
                (name, last_seen, last_seen, json.dumps(tags), json.dumps(tags)))

    def rename(self, old: str, new: str) -> bool:
        """Give device `old`'s row the name `new` (which must have none); whether `old` had a row."""
        with self._writing(), self._lock:
            return self._conn.execute("UPDATE devices SET name = ? WHERE name = ?", (new, old)).rowcount > 0

    def known(self, name: str) -> bool:
        """Whether a device of this name has registered at some time."""
        return bool(self._engine.read("SELECT 1 FROM devices WHERE name = ?", (name,)))


@dataclass(frozen=True)
class EnrolledKey:
    name: str
    public_key: str
    enrolled_at: float
    enrolled_by: str


class DeviceKeys:
    """The `device_keys` table of a `Store` (`store.device_keys`): name -> the device's Ed25519 public key
    and how it was enrolled (the rules are `tether.server.trust.device_keys`'s)."""

    def __init__(self, engine: Engine, tokens: Tokens) -> None:
        self._engine = engine
        self._tokens = tokens  # its writes note a change of the tokens, as every write beside the tokens' own

    def get(self, name: str) -> EnrolledKey | None:
        """The key enrolled for device `name`, or None."""
        rows = self._engine.read("SELECT public_key, enrolled_at, enrolled_by FROM device_keys WHERE name = ?",
                                 (name,))
        if not rows:
            return None
        row = rows[0]
        return EnrolledKey(name, row[0], row[1], row[2])

    def enroll_first(self, name: str, public_key: str, by: str) -> None:
        """Enrol `public_key` for `name` unless a key is enrolled already (then nothing changes)."""
        self._tokens._write("INSERT INTO device_keys (name, public_key, enrolled_at, enrolled_by) VALUES (?, ?, ?, ?) "
                            "ON CONFLICT (name) DO NOTHING", (name, public_key, time.time(), by))

    def put(self, name: str, public_key: str, by: str) -> None:
        """Enrol `public_key` for `name` in place of any key it had."""
        self._tokens._write("INSERT INTO device_keys (name, public_key, enrolled_at, enrolled_by) VALUES (?, ?, ?, ?) "
                            "ON CONFLICT (name) DO UPDATE SET public_key = excluded.public_key, "
                            "enrolled_at = excluded.enrolled_at, enrolled_by = excluded.enrolled_by",
                            (name, public_key, time.time(), by))

    def rename(self, old: str, new: str) -> None:
        """Move device `old`'s key and device tokens to the name `new` (a rename; `new` holds neither)."""
        self._tokens._write("UPDATE device_keys SET name = ? WHERE name = ?", (new, old))
        self._tokens._write("UPDATE tokens SET name = ? WHERE kind = 'device' AND name = ?", (new, old))

    def forget(self, name: str) -> None:
        """Forget the key of `name`, if any."""
        self._tokens._write("DELETE FROM device_keys WHERE name = ?", (name,))

    def forget_enrolled_by(self, name: str, pattern: str) -> None:
        """Forget the key of `name` if its `enrolled_by` matches the LIKE `pattern` (a pairing's approval)."""
        self._tokens._write("DELETE FROM device_keys WHERE name = ? AND enrolled_by LIKE ?", (name, pattern))
