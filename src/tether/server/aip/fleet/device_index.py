"""`NameIndex`: the registry's sorted name lists — all, by connection, by platform, by tag.

A page of the device list walks one of these from the cursor on, the smallest that every match must
be in, so a filtered page costs about what it holds and not what the fleet holds. Sorted Python lists
with bisect: a device joining, leaving or changing its profile moves a few names (memmove in C), which
is rare next to reads.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence


def insert(names: list[str], name: str) -> None:
    at = bisect_left(names, name)
    if at == len(names) or names[at] != name:
        names.insert(at, name)


def remove(names: list[str], name: str) -> None:
    at = bisect_left(names, name)
    if at < len(names) and names[at] == name:
        del names[at]


def literal_prefix(glob: str) -> str:
    """What every name matching `glob` starts with: the part before its first wildcard."""
    for at, char in enumerate(glob):
        if char in "*?[":
            return glob[:at]
    return glob


class NameIndex:
    def __init__(self) -> None:
        self.names: list[str] = []
        self.online: list[str] = []  # connected (online or busy)
        self.offline: list[str] = []
        self.by_platform: dict[str, list[str]] = {}  # lower-cased platform → names
        self.by_tag: dict[str, list[str]] = {}

    def add(self, name: str) -> None:
        """A new device, offline."""
        insert(self.names, name)
        insert(self.offline, name)

    def drop(self, name: str) -> None:
        for names in (self.names, self.online, self.offline):
            remove(names, name)

    def connected(self, name: str, connected: bool) -> None:
        remove(self.offline if connected else self.online, name)
        insert(self.online if connected else self.offline, name)

    def platform(self, name: str, old: str | None, new: str | None) -> None:
        if old is not None:
            key = old.lower()
            names = self.by_platform.get(key)
            if names is not None:
                remove(names, name)
                if not names:
                    del self.by_platform[key]
        if new is not None:
            insert(self.by_platform.setdefault(new.lower(), []), name)

    def tags(self, name: str, old: Sequence[str], new: Sequence[str]) -> None:
        for tag in set(old) - set(new):
            names = self.by_tag.get(tag)
            if names is not None:
                remove(names, name)
                if not names:
                    del self.by_tag[tag]
        for tag in set(new) - set(old):
            insert(self.by_tag.setdefault(tag, []), name)

    def candidates(self, status: str | None, platform: str | None, tags: Sequence[str]) -> list[str]:
        """The smallest sorted list every device matching these filters is in."""
        lists = [self.online if status in ("online", "busy") else self.offline if status == "offline"
                 else self.names]
        if platform is not None:
            lists.append(self.by_platform.get(platform.lower(), []))
        lists.extend(self.by_tag.get(tag, []) for tag in tags)
        return min(lists, key=len)

    @staticmethod
    def start(names: list[str], after: str | None, prefix: str) -> int:
        """Where a walk of `names` begins: past the cursor `after`, at the glob's literal prefix."""
        if after is not None and after >= prefix:
            return bisect_right(names, after)
        return bisect_left(names, prefix)
