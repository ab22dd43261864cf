"""Shared fixtures. Tests use real things; a missing prerequisite fails with the command that installs it."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NODE_PREFIX = REPO / ".tether-test-node"
NODE_INSTALL = "npm install --prefix .tether-test-node @modelcontextprotocol/server-filesystem"


@pytest.fixture(scope="session")
def node_mcp_bin() -> Path:
    """`@modelcontextprotocol/server-filesystem`, installed project-locally (never fetched by a test)."""
    if shutil.which("node") is None:
        pytest.fail("node is not on PATH; install Node.js 20+ (e.g. `apt-get install nodejs npm`)")
    path = NODE_PREFIX / "node_modules" / ".bin" / "mcp-server-filesystem"
    if not path.exists():
        pytest.fail(f"{path} is missing; install it from {REPO} with: {NODE_INSTALL}")
    return path


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a process the test is about to start
    and must tell its port; not handed to another worker of a parallel run (bench/kit/ports.py)."""
    from bench.kit.ports import free_port as pick

    return pick()


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Path]:
    """A private CA and a certificate for 127.0.0.1/localhost signed by it (`ca`, `cert`, `key` PEM files)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = {"ca": tmp_path / "ca.pem", "cert": tmp_path / "cert.pem", "key": tmp_path / "key.pem"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    cert.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    cert.private_key_pem.write_to_path(str(paths["key"]))
    return paths


@pytest.fixture(autouse=True)
def _tether_logging_restored() -> Iterator[None]:
    """Every test leaves the `tether` logger as it found it. A bench smoke test that builds `tether
    server`'s uvicorn config in this process (bench/gateway.py, bench/sessions.py through roundtrip)
    applies the server's logging set-up: the `tether` logger at WARNING and not propagating, after which
    every later test reading logs through caplog saw nothing (test_desktop_config failed in full runs)."""
    import logging

    loggers = [logging.getLogger(name) for name in ("tether", "uvicorn", "uvicorn.error", "uvicorn.access")]
    saved = [(lg, lg.level, lg.propagate, lg.disabled, list(lg.handlers)) for lg in loggers]
    yield
    for lg, level, propagate, disabled, handlers in saved:
        lg.setLevel(level)
        lg.propagate, lg.disabled, lg.handlers[:] = propagate, disabled, handlers


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sqlite_only(reason): cannot run against PostgreSQL, for the stated reason")
    _root_as_before()


def _root_as_before() -> None:
    """CI and this suite run as root, and a root device now refuses to start unless allowed, and runs its
    sandboxes as an unprivileged user (issue 26 item 7, docs/security/root.md). Hundreds of tests start
    devices (in this process and as `tether device` subprocesses, which inherit the environment) on
    directories only root can write, with an interpreter only root may run (pyenv under /root): they keep
    their behaviour of before through the two variables, set for the whole session. The tests of the root
    rules themselves (tests/attacks/test_root_device.py) unset them for their own processes."""
    import os

    os.environ.setdefault("TETHER_ALLOW_ROOT", "1")
    os.environ.setdefault("TETHER_RUN_AS", "root")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """TETHER_TEST_DB=postgres runs the server-side suite: the tests that start a server through a
    testkit (dbkit.keeps_server_state); the others are deselected, and so is a `sqlite_only` one (it must
    give its reason): each runs in the SQLite pass of the same `.ci/run`, nothing is skipped."""
    from tests.kits import db as dbkit

    if dbkit.backend() != "postgres":
        return
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("sqlite_only")
        if marker is not None and not (marker.kwargs.get("reason") or marker.args):
            raise pytest.UsageError(f"{item.nodeid}: sqlite_only needs a reason")
        (keep if marker is None and dbkit.starts_servers(item) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def _postgres_admin() -> Iterator[str | None]:
    """With TETHER_TEST_DB=postgres: the session's private PostgreSQL, its maintenance URL, and the
    session's database scope (set up before any module-scoped fixture starts a server). None otherwise."""
    from tests.kits import db as dbkit

    if dbkit.backend() != "postgres":
        yield None
        return
    with dbkit.postgres_session() as admin, dbkit.per_test_databases(admin, "s"):
        yield admin


@pytest.fixture(autouse=True)
def _test_database(request: pytest.FixtureRequest) -> Iterator[None]:
    """With TETHER_TEST_DB=postgres: a fresh database for each server state the test keeps, dropped after."""
    from tests.kits import db as dbkit

    if dbkit.backend() != "postgres":
        yield
        return
    admin = request.getfixturevalue("_postgres_admin")
    assert admin is not None
    with dbkit.per_test_databases(admin):
        yield
