"""Issue 10, item 10: a command cut off by a device shutdown says its outcome is unknown; the server log
records devices registering and going offline (peer-supplied text escaped); a task summary counts
every step of the plan, skipped ones included.

The first two run a real `tether server` (logging at info into a file) and a real `tether device`
process; the summaries run the agent server in-process with real devices over AIP (a restart of the
server is part of the story).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.kits.aip import FakeDevice
from tests.kits.netutil import Proc, free_port, tether_env, wait_for
from tests.kits.task import AgentServer
from tether.client.rest import RemoteServer
from tether.protocol.messages import Event, ServerMessageType
from tether.protocol.models import Command
from tether.server.store import Store
from tether.tools.policy.model import default_policy

WAITER = """
import signal
print("started", flush=True)
signal.pause()  # until the device's shutdown kills it
"""


class Server:
    """`tether server --log-level info` with an admin API token and device tokens for alpha and gamma."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.state = tmp / "state"
        self.state.mkdir()
        db = self.state / "server.db"
        store = Store(str(db))
        _, self.api_token = store.tokens.create("api", "admin", ["read", "execute", "admin"])
        self.device_tokens = {n: store.tokens.create("device", n, [])[1] for n in ("alpha", "gamma")}
        store.close()
        self.port = free_port()
        self.env = tether_env(self.state)
        self.proc = Proc(["server", "--port", str(self.port), "--db", str(db), "--log-level", "info"],
                         tmp / "server.log", self.env)
        self.remote = RemoteServer(f"http://127.0.0.1:{self.port}", self.api_token)
        wait_for(lambda: self.remote.health()["status"] == "ok", "server health", procs=(self.proc.popen,))

    def device(self, name: str, policy: Path, temp: Path) -> Proc:
        return Proc(["device", "--server", f"ws://127.0.0.1:{self.port}", "--name", name, "--policy", str(policy),
                     "--state-dir", str(self.state / f"dev-{name}")], self.tmp / f"device-{name}.log",
                    {**self.env, "TETHER_DEVICE_TOKEN": self.device_tokens[name], "TMPDIR": str(temp)})

    def online(self, name: str) -> bool:
        return any(d["name"] == name and d["status"] in ("online", "busy") for d in self.remote.devices())

    def close(self) -> None:
        self.remote.close()
        self.proc.stop()


@pytest.fixture
def server(tmp_path: Path) -> Any:
    s = Server(tmp_path)
    yield s
    s.close()


def test_a_command_cut_off_by_a_device_shutdown_reports_its_outcome_as_unknown(server: Server,
                                                                               tmp_path: Path) -> None:
    root, temp = tmp_path / "root", tmp_path / "device-temp"
    root.mkdir()
    temp.mkdir()
    (root / "waiter.py").write_text(WAITER)
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"read_roots: {json.dumps([str(root)])}\nwrite_roots: {json.dumps([str(root), str(temp)])}\n")
    device = server.device("alpha", policy, temp)
    try:
        wait_for(lambda: server.online("alpha"), "alpha online", 60, (device.popen,))
        running = Command(tool_name="shell.run", parameters={"cmd": "python3", "cwd": str(root),
                                                             "argv": [str(root / "waiter.py")]})
        queued = Command(tool_name="shell.run", parameters={"cmd": "echo", "argv": ["later"], "cwd": str(root)})

        def on_event(event: Event) -> None:  # the command is running: stop the device (as Ctrl-C or systemd would)
            if event.kind == "output" and "started" in str(event.data.get("data")):
                device.popen.send_signal(signal.SIGTERM)

        _, results = server.remote.run("alpha", [running, queued], timeout=60, on_event=on_event)
        assert device.popen.wait(timeout=30) == 0, device.output()
    finally:
        device.stop()
    first, second = results
    assert first.status.value == "failure" and first.error.startswith(
        "outcome unknown: the command was running when the device shut down"), first.error
    assert second.status.value == "failure" and second.error == "not run: the device is shutting down"
    audit = {r["call_id"]: r for r in server.remote._request("GET", "/audit", params={"limit": 20})["rows"]}
    assert audit[running.call_id]["error"] == first.error and audit[queued.call_id]["error"] == second.error
    wait_for(lambda: "device alpha offline" in server.proc.output(), "the offline line", 30)
    log = server.proc.output()
    registered = [line for line in log.splitlines() if "device alpha registered from 127.0.0.1:" in line]
    assert len(registered) == 1 and registered[0].startswith("INFO:") and "tether.server.hub" in registered[0]
    assert any(line.startswith("INFO:") and "device alpha offline" in line for line in log.splitlines())


async def test_register_and_offline_lines_escape_what_the_peer_chose(server: Server) -> None:
    forged = "x\nINFO:     tether.server.hub: device admin registered from 10.0.0.1 (instance \x1b[2Jz)"
    fake = FakeDevice(f"ws://127.0.0.1:{server.port}/aip", server.device_tokens["gamma"], name="gamma",
                      instance_id=forged)
    ack = await fake.register()
    assert ack.type is ServerMessageType.REGISTER_ACK
    assert fake.ws is not None
    await fake.ws.close()
    wait_for(lambda: "device gamma offline" in server.proc.output(), "the offline line", 30)
    lines = server.proc.output().splitlines()
    [registered] = [line for line in lines if "device gamma registered from 127.0.0.1:" in line]
    assert "(instance x\\nINFO:     tether.server.hub: device admin registered" in registered
    assert "\\x1b[2Jz)" in registered and "\x1b" not in "\n".join(lines)
    assert not any(line.startswith("INFO:     tether.server.hub: device admin") for line in lines)


# -- the summary ------------------------------------------------------------------------------------

def shell(cmd: str, argv: list[str], cwd: Path, description: str) -> dict[str, Any]:
    return {"skill": "shell.run", "args": {"cmd": cmd, "argv": argv, "cwd": str(cwd)}, "description": description}


def jailed(tmp_path: Path) -> tuple[Any, Path]:
    root = tmp_path / "alpha"
    root.mkdir()
    return default_policy().model_copy(update={"read_roots": [str(root)], "write_roots": [str(root)]}), root


async def test_a_step_skipped_after_a_restart_counts_as_a_step_that_did_not_succeed(tmp_path: Path) -> None:
    policy, root = jailed(tmp_path)
    db = tmp_path / "server.db"
    plan = [shell("echo", ["one"], root, "first"), shell("sleep", ["60"], root, "the long one"),
            shell("echo", ["three"], root, "third")]
    async with AgentServer(tmp_path, db_path=db) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="three steps", device="alpha", plan=plan)
        await server.events_until(created["id"], lambda e: e["kind"] == "step_started" and e["data"]["step"] == 1)
    async with AgentServer(tmp_path, db_path=db) as server:  # restarted in the middle of step 2
        await server.add_device("alpha", policy, tmp_path / "state-alpha-2")
        # the step in flight is first asked about on the device (a new process: no record of it), then the person
        await server.events_until(created["id"], lambda e: e["kind"] == "question" and e["data"]["kind"] == "restart")
        waiting = (await server.api.get(f"/tasks/{created['id']}")).json()
        assert waiting["questions"][-1]["kind"] == "restart"
        answered = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "skip this step"})
        assert answered.status_code == 200, answered.text
        task = await server.finished(created["id"])
    assert task["state"] == "done", task["error"]
    assert [s["index"] for s in task["steps"]] == [0, 2]  # the skipped step never ran again
    lines = task["answer"].splitlines()
    assert lines[0] == "Done: 2 of 3 step(s) succeeded (1 skipped) for “three steps”."
    assert lines[1:] == ["✓ 1. first — one", "- 2. the long one — skipped, not run", "✓ 3. third — three"]


async def test_a_step_skipped_after_it_failed_is_listed_as_skipped(tmp_path: Path) -> None:
    policy, root = jailed(tmp_path)
    plan = [shell("echo", ["one"], root, "first"), shell("false", [], root, "the failing one"),
            shell("echo", ["three"], root, "third")]
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        created = await server.create(request="three steps", device="alpha", plan=plan)
        asked = await server.events_until(created["id"], lambda e: e["kind"] == "question")
        assert "skip this step" in asked[-1]["data"]["options"]
        answered = await server.api.post(f"/tasks/{created['id']}/answer", json={"answer": "skip this step"})
        assert answered.status_code == 200, answered.text
        task = await server.finished(created["id"])
    assert task["state"] == "done", task["error"]
    lines = task["answer"].splitlines()
    assert lines[0] == "Done: 2 of 3 step(s) succeeded (1 skipped) for “three steps”."
    assert lines[2].startswith("- 2. the failing one — skipped after it failed: ") and "exit code 1" in lines[2]
