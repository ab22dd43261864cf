"""What the device itself will run later is a protected path: its MCP servers' programs and its own code.

The device starts each configured stdio server itself, most often unsandboxed, with the user's full rights,
at every start (and at a reset); it imports each `module:` server into its own process, and its own code at
its next start. Any of those lying inside a write root would otherwise be a door out of the sandbox: a command
or file tool rewrites it, and the device runs the agent's code outside any sandbox next time. So the device
adds to its policy's `protected_paths`, when it starts:

- each stdio server's command file and each argument that names an existing file, and the directory holding
  such a file (a script imports its neighbours), unless that directory is the home directory or holds a write
  root (then only the file);
- the virtual environment a stdio server's command lies in (`~/srv/.venv/bin/python`: its `pyvenv.cfg`, its
  `bin/` and its `site-packages`, which the command imports from), whole;
- each directory of a stdio server's `PATH` (its own `env`'s or the device's) inside a write root, unless it is
  the home directory or holds a write root: the programs a server runs by name (`node` for `npx`) come from
  there; likewise its `env`'s `PYTHONPATH` and `NODE_PATH` directories, the working directory of a
  `python -m NAME` server (first on its import path; when that is too broad, `NAME.py` and `NAME/` in it), and
  a `uv run` server's project (`--directory`, `--project`, or its working directory);
- for a server started unsandboxed through a package runner (`npx`, `npm exec`, `pnpm dlx`, `uvx`, `uv`,
  `pipx`, `bunx`), the runner's store it runs the package from: `<npm cache>/_npx`, pnpm's, uv's cache and
  data directories, pipx's home and cache, bun's install cache (each as the server's `env` sets it, or the
  default). A sandboxed one is left out: it must write its runner's store itself, and its code stays confined;
- a `module:` server's module, found with `importlib.util.find_spec` for its top-level name and the path
  finder for the rest (nothing is imported or run): its top-level package directory or module file, the
  `sys.path` entry holding it unless that is the home directory or holds a write root, and in each entry
  searched before that one the names that would shadow it (`NAME.py`, `NAME/`, ...);
- the device's own interpreter: its virtual environment (`sys.prefix` when it differs from
  `sys.base_prefix`), its executable, and each `sys.path` entry (site-packages, an editable checkout's `src`)
  inside a write root, unless it is the home directory or holds a write root; and the names that would
  shadow the `tether` package itself in the entries searched before its own.

Only places inside the write roots (captured and live) are added: elsewhere nothing the device runs can write.
Creating or changing any of them then waits for a person, like any protected path; a live process sees them
read-only. Names with glob characters are left out (they could not be matched literally).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig
    from tether.device.mcp.config.server_config import MCPServerConfig
    from tether.tools.policy.model import Policy

logger = logging.getLogger(__name__)
_GLOB = re.compile(r"[*?\[\]]")
_UV = frozenset({"uv", "uvx"})


def server_programs(config: DeviceConfig, write_roots: list[str]) -> list[str]:
    """The absolute paths to protect for `config`'s MCP servers (see the module's docstring), each as written
    and as its real path (a symlink on the way decides what runs): for each stdio server its command file (a
    bare name through the server's `PATH`), existing files among its arguments (relative ones from the
    server's `cwd`), the directory of each unless it is the home directory or a write root lies at or below
    it, the virtual environment its command lies in, its `PATH` and import directories, and an unsandboxed
    one's package-runner store; for each `module:` server its module. Only places whose real path lies inside
    `write_roots` (the captured and the live ones) are kept. Never raises for a missing or odd entry: it is
    just left out."""
    home = os.path.realpath(os.path.expanduser("~"))
    roots = [os.path.realpath(os.path.expanduser(r)) for r in write_roots]
    found: list[str] = []
    for agent in config.mcp.values():
        for root in agent.values():
            for _, server in root.servers():
                if server.server_type == "stdio" and server.command:
                    found += _stdio_places(server, home, roots)
                elif server.server_type == "local" and server.module:
                    found += _module_places(server.module, sys.path, home, roots)
    return _inside(found, roots)


def own_programs(write_roots: list[str], *, prefix: str | None = None, base_prefix: str | None = None,
                 executable: str | None = None, path: Sequence[str] | None = None) -> list[str]:
    """The absolute paths (as given and real) of the device's own code inside `write_roots`: the virtual
    environment `prefix` when it is one (`prefix` differs from `base_prefix`), the interpreter `executable`,
    each existing directory on `path` (the import path) unless it is the home directory or holds a write
    root, and the names that would shadow the `tether` package in the entries searched before its own (as
    for a `module:` server). The keyword arguments default to this process's own (`sys`, read at the call);
    never raises."""
    prefix, base_prefix = prefix or sys.prefix, base_prefix or sys.base_prefix
    executable = sys.executable if executable is None else executable
    path = list(sys.path) if path is None else path
    home = os.path.realpath(os.path.expanduser("~"))
    roots = [os.path.realpath(os.path.expanduser(r)) for r in write_roots]
    found: list[str] = []
    if os.path.realpath(prefix) != os.path.realpath(base_prefix):
        found.append(prefix)
    if executable:
        found += [executable, *_venv([os.path.dirname(executable)])]
    for entry in path:
        if entry and os.path.isdir(entry) and not _broad(os.path.realpath(entry), home, roots):
            found.append(entry)
    return _inside([*found, *_module_places("tether", path, home, roots)], roots)


def _inside(places: list[str], roots: list[str]) -> list[str]:
    """`places` as written and as their real paths, where the real one lies inside `roots`."""
    both = [q for p in places for q in (os.path.abspath(p), os.path.realpath(p))]
    return [p for p in dict.fromkeys(both) if not _GLOB.search(p)
            and any(_within(os.path.realpath(p), r) for r in roots)]


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _broad(directory: str, home: str, roots: list[str]) -> bool:
    """Whether protecting `directory` whole would hold the write roots themselves (home, `/`, or above one)."""
    return directory in (home, "/") or any(_within(r, directory) for r in roots)


def _places(file: str, home: str, roots: list[str]) -> list[str]:
    directory = os.path.dirname(file)
    return [file] if _broad(directory, home, roots) else [file, directory]


def _venv(directories: list[str]) -> list[str]:
    """The virtual environment (a directory holding `pyvenv.cfg`) at or just above each of `directories`."""
    found = []
    for directory in directories:
        for candidate in (directory, os.path.dirname(directory)):
            if os.path.isfile(os.path.join(candidate, "pyvenv.cfg")):
                found.append(candidate)
                break
    return found


def _stdio_places(server: MCPServerConfig, home: str, roots: list[str]) -> list[str]:
    env = {"HOME": os.path.expanduser("~"), "PATH": os.environ.get("PATH", os.defpath)} | (server.env or {})
    base = os.path.expanduser(server.cwd) if server.cwd else os.getcwd()
    command = os.path.expanduser(str(server.command))
    located = command if os.sep in command else shutil.which(command, path=env["PATH"])
    found: list[str] = []
    for candidate in [located, *(os.path.join(base, os.path.expanduser(a)) for a in server.args)]:
        if candidate and os.path.isfile(candidate):  # as written too: a symlink on the way decides what runs
            found += [*_places(os.path.realpath(candidate), home, roots), os.path.abspath(candidate)]
    if located:  # the venv as written: its bin/python is a symlink to an interpreter elsewhere
        written = os.path.abspath(os.path.dirname(located))
        found += [*_venv([os.path.realpath(written)]), *_venv([written])]
    name = os.path.basename(command)
    directories = [*env["PATH"].split(os.pathsep), *_import_dirs(name, list(server.args), base, env)]
    if name.startswith("python") and "-m" in server.args[:-1]:  # its working directory is first on its path
        top = server.args[server.args.index("-m") + 1].split(".")[0]
        found += [os.path.join(base, top + ".py"), os.path.join(base, top)]  # when that directory is too broad
    for directory in directories:
        real = os.path.realpath(os.path.join(base, os.path.expanduser(directory))) if directory else ""
        if real and os.path.isdir(real) and not _broad(real, home, roots):
            found.append(real)
    if not server.sandbox:
        found += _runner_stores(name, env)
    return found


def _import_dirs(name: str, args: list[str], base: str, env: Mapping[str, str]) -> list[str]:
    """The directories a server's program imports from that no file argument names: its `env`'s
    `PYTHONPATH` and `NODE_PATH`, the working directory `base` of `python -m`, and the project of `uv run`
    (`--directory`/`--project`, or `base`)."""
    found = [p for key in ("PYTHONPATH", "NODE_PATH") for p in env.get(key, "").split(os.pathsep) if p]
    if name.startswith("python") and "-m" in args[:-1]:
        found.append(base)
    if name == "uv":
        given = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--directory", "--project")]
        given += [a.split("=", 1)[1] for a in args if a.startswith(("--directory=", "--project="))]
        found += given or [base]
    return found


def _runner_stores(name: str, env: Mapping[str, str]) -> list[str]:
    """Where the package runner `name` keeps the packages it runs, as `env` sets them (else the defaults)."""
    home = env.get("HOME") or os.path.expanduser("~")
    cache = env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    data = env.get("XDG_DATA_HOME") or os.path.join(home, ".local", "share")
    if name in ("npx", "npm"):
        npm_cache = env.get("npm_config_cache") or env.get("NPM_CONFIG_CACHE") or os.path.join(home, ".npm")
        return [os.path.join(npm_cache, "_npx")]
    if name in ("pnpx", "pnpm"):
        return [os.path.join(cache, "pnpm"), os.path.join(data, "pnpm")]
    if name in _UV:
        return [env.get("UV_CACHE_DIR") or os.path.join(cache, "uv"), env.get("UV_TOOL_DIR") or
                os.path.join(data, "uv"), env.get("UV_PYTHON_INSTALL_DIR") or os.path.join(data, "uv")]
    if name == "pipx":
        return [env.get("PIPX_HOME") or os.path.join(data, "pipx"), os.path.join(home, ".local", "pipx"),
                os.path.join(cache, "pipx")]
    if name in ("bunx", "bun"):
        return [env.get("BUN_INSTALL_CACHE_DIR") or os.path.join(home, ".bun", "install", "cache")]
    return []


def _module_places(module: str, path: Sequence[str], home: str, roots: list[str]) -> list[str]:
    """Where the module `module` would be imported from, found without importing or running anything: the
    top-level name through `importlib.util.find_spec` (which looks only), each further part through the path
    finder in its parent's locations. Its top-level package directory or module file, the `sys.path` entry
    holding it (unless too broad to protect), the file of the named module itself, and in each entry of
    `path` searched before that one (all of them when it is not found) the names that would shadow it
    (`NAME/`, `NAME.py`, `NAME.pyc`, `NAME` with each extension-module suffix), existing or not."""
    top, *rest = module.split(".")
    try:
        spec = sys.modules[top].__spec__ if top in sys.modules else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    found: list[str] = []
    if spec is not None:
        for place in [*(spec.submodule_search_locations or []), *([spec.origin] if spec.has_location else [])]:
            real = os.path.realpath(str(place))
            found.append(os.path.dirname(real) if os.path.basename(real).startswith("__init__.") else real)
    holders = {os.path.dirname(place) for place in found}
    for entry in dict.fromkeys(os.path.realpath(e or os.curdir) for e in path):
        if entry in holders:
            found += [] if _broad(entry, home, roots) else [entry]
            break
        found += [os.path.join(entry, top + suffix) for suffix in ("", *importlib.machinery.all_suffixes())]
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for part in rest:  # a deeper module: the package directories above it are already protected whole
        sub = importlib.machinery.PathFinder.find_spec(part, locations) if locations else None
        if sub is None:
            break
        if sub.origin and sub.has_location:
            found.append(os.path.realpath(sub.origin))
        locations = list(sub.submodule_search_locations or [])
    return found


def with_server_programs(policy: Policy, config: DeviceConfig) -> Policy:
    """`policy` with `server_programs` and `own_programs` added to its `protected_paths` (the same policy
    when none)."""
    roots = [*policy.write_roots, *policy.live_write_roots]
    places = [p for p in dict.fromkeys([*server_programs(config, roots), *own_programs(roots)])
              if p not in policy.protected_paths]
    if not places:
        return policy
    logger.info("protected, since the device itself runs or imports them later: %s", ", ".join(places))
    return policy.model_copy(update={"protected_paths": [*policy.protected_paths, *places]})


__all__ = ["own_programs", "server_programs", "with_server_programs"]
