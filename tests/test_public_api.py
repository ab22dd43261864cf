"""The public API of `import tether`: exactly these names, each resolving, loaded lazily."""

from __future__ import annotations

import importlib.util
import inspect
import json
import subprocess
import sys

import tether

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
# provided by tether.device.serve, which lands with the device helper's branch: checked once it exists
DEVICE_SERVE = {"open_device", "serve_device"}


def _present(name: str) -> bool:
    return name not in DEVICE_SERVE or importlib.util.find_spec("tether.device.serve") is not None


def test_all_is_exactly_the_public_names() -> None:
    assert set(tether.__all__) == EXPECTED
    assert len(tether.__all__) == len(EXPECTED), "a name is listed twice"


def test_each_name_resolves_and_is_documented() -> None:
    for name in tether.__all__:
        if not _present(name):
            continue
        value = getattr(tether, name)
        assert value is not None, name
        if inspect.isclass(value) or inspect.isfunction(value):
            assert inspect.getdoc(value), f"tether.{name} has no docstring"


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
