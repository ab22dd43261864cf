"""`tether.server.http.internals` against the installed Starlette and uvicorn: their versions are within the range
the module was written for (and pyproject.toml pins), and every private name it uses is still there, so an
upgrade fails here and not in a running server."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest

from tether.server.http import internals

ROOT = Path(__file__).resolve().parents[3]


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _resolve(target: str) -> object:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("package", sorted(internals.WRITTEN_FOR))
def test_installed_version_is_one_the_module_was_written_for(package: str) -> None:
    lowest, beyond = internals.WRITTEN_FOR[package]
    installed = version(package)
    assert _release(lowest) <= _release(installed) < _release(beyond), (
        f"{package} {installed} is outside [{lowest}, {beyond}), the versions tether.server.http.internals was "
        "written for: check each private name it uses against the new version, then move the range here and "
        "in pyproject.toml")


@pytest.mark.parametrize("package", sorted(internals.WRITTEN_FOR))
def test_pyproject_pins_the_same_range(package: str) -> None:
    lowest, beyond = internals.WRITTEN_FOR[package]
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"{package}>={lowest},<{beyond}" in dependencies


@pytest.mark.parametrize("target", sorted(internals.PRIVATE_NAMES))
def test_every_private_name_exists(target: str) -> None:
    owner = _resolve(target)
    assert owner is not None, f"{target} is None"
    missing = [name for name in internals.PRIVATE_NAMES[target] if not hasattr(owner, name)]
    assert not missing, f"{target} no longer has {missing}"


async def test_uvicorn_protocol_instances_have_the_attributes_used() -> None:
    import uvicorn
    from uvicorn.server import ServerState

    config = uvicorn.Config(app=lambda scope, receive, send: None, lifespan="off")
    config.load()
    base = internals.http_protocol_base()
    protocol = base(config=config, server_state=ServerState(), app_state={},  # type: ignore[call-arg]
                    _loop=asyncio.get_running_loop())
    missing = [name for name in internals.PROTOCOL_ATTRIBUTES if not hasattr(protocol, name)]
    assert not missing, f"{base.__name__} instances no longer have {missing}"
    cycle_class = inspect.getmodule(base).RequestResponseCycle  # type: ignore[union-attr]
    source = inspect.getsource(cycle_class.__init__)
    missing = [name for name in internals.CYCLE_ATTRIBUTES if f"self.{name} =" not in source]
    assert not missing, f"uvicorn's RequestResponseCycle no longer sets {missing}"


def test_uvicorn_log_lines_are_the_ones_filtered() -> None:
    from uvicorn.protocols.websockets import websockets_sansio_impl

    assert internals.DEFAULT_FORMATTER == "uvicorn.logging.DefaultFormatter"
    assert _resolve(internals.DEFAULT_FORMATTER.rpartition(".")[0] + ":DefaultFormatter")
    assert repr(internals.ACCESS_LINE) in inspect.getsource(inspect.getmodule(internals.http_protocol_base()))
    websocket_source = inspect.getsource(inspect.getmodule(internals.websocket_protocol_base()))
    assert repr(internals.WEBSOCKET_LINE)[:-1] in websocket_source  # the start of its handshake lines
    assert f'"{internals.SPURIOUS_HANDSHAKE_ERROR}"' in inspect.getsource(websockets_sansio_impl)
    assert {"uvicorn.access", "uvicorn.error"} <= set(internals.uvicorn_logging_config()["loggers"])


async def test_starlette_instances_have_the_attributes_used() -> None:
    from starlette.requests import Request
    from starlette.websockets import WebSocket

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    sent: list[dict[str, object]] = []
    assert internals.STARLETTE_ATTRIBUTES == ("WebSocket._send", "Request._body")
    websocket = WebSocket({"type": "websocket", "path": "/aip", "headers": []}, receive=send, send=send)
    await internals.websocket_send_raw(websocket, {"type": "websocket.send", "text": "x"})
    assert sent == [{"type": "websocket.send", "text": "x"}]
    assert "self._body" in inspect.getsource(Request.body)


def test_starlette_reads_what_internals_sets() -> None:
    from starlette.requests import Request

    app = object()
    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    internals.enter_app(scope, app)
    internals.set_path_params(scope, {"name": "alpha"})
    request = Request(scope)
    internals.keep_body(request, b"{}")
    assert request.app is app
    assert request.path_params == {"name": "alpha"}
    assert asyncio.run(request.body()) == b"{}"
