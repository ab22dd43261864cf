"""Fixtures of the fuzzing suite: a live agent server per module and one client event loop."""

from __future__ import annotations

import asyncio

import pytest

from tests.kits.fuzz import LiveServer


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory):
    server = LiveServer(tmp_path_factory.mktemp("fuzz-server"))
    yield server
    server.close()
    assert server.crashed is None, f"the server's thread ended with {server.crashed!r}"


@pytest.fixture(scope="module")
def runner():
    """One event loop for the client side of a module's examples (tests call `runner.run(...)`)."""
    with asyncio.Runner() as loop_runner:
        yield loop_runner
