"""The first admin token (README, first hour): `tether server` says how to make it while there is none;
`tether token create --admin` makes it on the server's machine and saves it — never printed, never on a
command line — in a file only its owner reads, where the CLI finds it."""

from __future__ import annotations

import stat
import subprocess
from pathlib import Path

import pytest

from tests.kits.netutil import CLI, tether_env
from tether.cli.commands.setup.settings import _first_admin_hint
from tether.client.rest import RemoteServer
from tether.server.store import Store


def test_token_create_admin_saves_the_token_0600_where_the_cli_reads_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    state, config = tmp_path / "state", tmp_path / "config"
    state.mkdir()
    db = state / "server.db"
    _first_admin_hint(db, None)
    assert "tether token create --admin" in capsys.readouterr().err.replace("\n", " ")

    env = {**tether_env(state), "XDG_CONFIG_HOME": str(config)}
    env.pop("TETHER_TOKEN", None)
    env.pop("TETHER_TOKEN_FILE", None)
    made = subprocess.run([*CLI, "token", "create", "--admin", "--db", str(db)], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert made.returncode == 0, made.stderr
    saved = config / "tether" / "token"
    secret = saved.read_text().strip()
    assert secret and secret not in made.stdout + made.stderr  # shown nowhere but the file
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    assert str(saved) in made.stderr.replace("\n", "")
    store = Store(db)
    try:
        info = store.tokens.verify(secret)
        assert info is not None and info.allows("admin") and info.allows("approve") and not info.agent
    finally:
        store.close()
    _first_admin_hint(db, None)
    assert capsys.readouterr().err == ""  # made: the hint is gone

    again = subprocess.run([*CLI, "token", "create", "--admin", "--db", str(db)], capture_output=True, text=True,
                           env=env, timeout=60, check=False)
    assert again.returncode == 2 and "never overwritten" in again.stderr and saved.read_text().strip() == secret

    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    monkeypatch.delenv("TETHER_TOKEN", raising=False)
    monkeypatch.delenv("TETHER_TOKEN_FILE", raising=False)
    with RemoteServer("http://127.0.0.1:1") as remote:
        assert remote.token == secret
    monkeypatch.setenv("TETHER_TOKEN", "from-env")  # the environment still wins
    with RemoteServer("http://127.0.0.1:1") as remote:
        assert remote.token == "from-env"
