"""The programs of the device's own stdio MCP servers are protected paths.

The device starts each configured stdio server itself, most often unsandboxed, with the user's full
rights, at every start (and at a reset). A server whose program lies inside a write root (`python
~/tools/srv/server.py`, `command: ~/work/srv/run`) would otherwise be a door out of the sandbox: a
command or file tool rewrites it, and the device runs the agent's code outside any sandbox next time.
So the device adds, to its policy's `protected_paths`, each stdio server's command file and each
argument that names an existing file, and the directory holding such a file (a script imports its
neighbours), unless that directory is the home directory or holds a write root (then only the file).
Creating or changing any of them then waits for a person, like any protected path; a live process
sees them read-only. Names with glob characters are left out (they could not be matched literally).
"""

from __future__ import annotations

import os
import re
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig
    from tether.tools.policy.model import Policy

_GLOB = re.compile(r"[*?\[\]]")


def server_programs(config: DeviceConfig, write_roots: list[str]) -> list[str]:
    """The absolute real paths to protect for `config`'s stdio servers (see the module's docstring):
    command files found on disk (a bare name through PATH) and existing files among the arguments
    (relative ones from the server's `cwd`) that lie inside `write_roots` (the captured and the live ones;
    elsewhere nothing the device runs can write), and the directory of each unless it is the home
    directory or a write root lies at or below it. Never raises for a missing or odd entry: it is just
    left out."""
    home = os.path.realpath(os.path.expanduser("~"))
    roots = [os.path.realpath(os.path.expanduser(r)) for r in write_roots]
    found: list[str] = []
    for agent in config.mcp.values():
        for root in agent.values():
            for _, server in root.servers():
                if server.server_type != "stdio" or not server.command:
                    continue
                base = os.path.expanduser(server.cwd) if server.cwd else os.getcwd()
                command = os.path.expanduser(server.command)
                located = command if os.sep in command else shutil.which(command)
                for candidate in [located, *(os.path.join(base, os.path.expanduser(a)) for a in server.args)]:
                    real = os.path.realpath(candidate) if candidate and os.path.isfile(candidate) else None
                    if real is not None and any(_within(real, r) for r in roots):  # elsewhere: read-only anyway
                        found += _places(real, home, roots)
    return [p for p in dict.fromkeys(found) if not _GLOB.search(p)]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _places(file: str, home: str, roots: list[str]) -> list[str]:
    directory = os.path.dirname(file)
    holds_root = any(_within(r, directory) for r in roots)
    return [file] if directory in (home, "/") or holds_root else [file, directory]


def with_server_programs(policy: Policy, config: DeviceConfig) -> Policy:
    """`policy` with `server_programs` added to its `protected_paths` (the same policy when none)."""
    roots = [*policy.write_roots, *policy.live_write_roots]
    places = [p for p in server_programs(config, roots) if p not in policy.protected_paths]
    if not places:
        return policy
    return policy.model_copy(update={"protected_paths": [*policy.protected_paths, *places]})


__all__ = ["server_programs", "with_server_programs"]
