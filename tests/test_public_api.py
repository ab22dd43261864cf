"""The public API of `import tether` and `tether.client`: exactly these names, each resolving, loaded lazily, and
what a type checker reads (the `TYPE_CHECKING` imports) the same objects as what a program gets."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import tether
import tether.client

EXPECTED = {
    "AsyncClient", "Client",                                          # tether.client
    "open_device", "serve_device",                                    # tether.device.serve
    "ServerSettings", "create_app", "run_server",                     # tether.server
    "Command", "DeviceProfile", "DeviceRequirements", "Event", "Result", "ResultStatus", "ToolInfo",
    "ToolType",                                                       # tether.protocol
    "ToolContext", "ToolSet", "tool",                                 # tether.tools
    "AgentError", "ClientError", "ConfigError", "DeviceError", "ProtocolError", "SandboxError", "ServerError",
    "TetherError", "ToolAreaError",                                   # tether.errors
}
CLIENT = {
    "AsyncClient", "Client",                                          # tether.client.aio, .sync
    "ClientError", "ConnectError", "HTTPStatusError", "IncompleteStream", "RequestTimeout",
    "TransportError",                                                 # tether.client.errors
    "AuditPage", "BatchResults", "Device", "DeviceDetail", "FanOutOutcome", "FanOutReport", "FanOutSummary",
    "TaskEnd", "TaskSummary",                                         # tether.client.responses
}
FACADES = [(tether, EXPECTED), (tether.client, CLIENT)]


def _checked_imports(facade: ModuleType) -> dict[str, str]:
    """Each name the facade imports under `if TYPE_CHECKING:` (what mypy reads), with its module."""
    tree = ast.parse(Path(str(facade.__file__)).read_text(encoding="utf-8"))
    [block] = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    return {alias.asname or alias.name: str(node.module) for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}


@pytest.mark.parametrize(("facade", "expected"), FACADES, ids=["tether", "tether.client"])
def test_all_is_exactly_the_public_names(facade: ModuleType, expected: set[str]) -> None:
    assert set(facade.__all__) == expected
    assert list(facade.__all__) == sorted(expected), "__all__ is listed once each, sorted"


@pytest.mark.parametrize(("facade", "expected"), FACADES, ids=["tether", "tether.client"])
def test_the_lazy_names_the_checked_names_and_all_agree(facade: ModuleType, expected: set[str]) -> None:
    """A name loaded lazily but missing from `__all__` (or from the `TYPE_CHECKING` imports) would be public to a
    program and not to a reader or a type checker, or the other way round; each name is the very object of the
    module the type checker is told it comes from."""
    lazy = set(dir(facade)) - set(vars(facade))
    assert lazy == expected
    checked = _checked_imports(facade)
    assert set(checked) == expected
    for name, module in checked.items():
        assert getattr(facade, name) is getattr(importlib.import_module(module), name), name


@pytest.mark.parametrize(("facade", "expected"), FACADES, ids=["tether", "tether.client"])
def test_each_name_resolves_and_is_documented(facade: ModuleType, expected: set[str]) -> None:
    for name in facade.__all__:
        value = getattr(facade, name)
        assert value is not None, name
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"{facade.__name__}.{name} has no docstring"


def test_error_tree() -> None:
    for name in ("AgentError", "ClientError", "ConfigError", "DeviceError", "ProtocolError", "SandboxError",
                 "ServerError", "ToolAreaError"):
        assert issubclass(getattr(tether, name), tether.TetherError), name
    from tether.client import ConnectError, HTTPStatusError

    assert issubclass(HTTPStatusError, tether.ClientError) and issubclass(ConnectError, tether.ClientError)


def test_dir_lists_the_public_names() -> None:
    assert set(dir(tether)) >= EXPECTED
    assert "__version__" in dir(tether)


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        tether.NoSuchThing  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("tether.NoSuchThing resolved")


def test_import_tether_imports_nothing_heavy() -> None:
    """`import tether` loads the facade, its lazy-import helper and the version: no pydantic, httpx, server."""
    code = ("import json, sys; before = set(sys.modules); import tether; "
            "print(json.dumps(sorted(set(sys.modules) - before)))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    modules = json.loads(loaded)
    ours = sorted(m for m in modules if m.startswith("tether"))
    assert ours == ["tether", "tether.imports", "tether.version"], ours
    for heavy in ("pydantic", "httpx", "fastapi", "starlette", "websockets", "typer", "rich"):
        assert not any(m == heavy or m.startswith(heavy + ".") for m in modules), heavy


def test_a_name_loads_its_module_only_when_read() -> None:
    code = ("import sys, tether; assert 'tether.protocol.models' not in sys.modules; tether.Command; "
            "assert 'tether.protocol.models' in sys.modules; assert 'tether.client.sync' not in sys.modules; "
            "assert 'tether.server.http.app' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
