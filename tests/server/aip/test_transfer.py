"""Files that travel between devices: a real `tether server` and two real `tether device` processes (shared by
the module), transfers over REST, the Python client and `tether cp`.

A directory goes from alpha to beta with every file's sha256 checked and is then undone on beta; a transfer
survives beta being killed and started again mid-file (it resumes from the offset beta's partial file holds:
fewer bytes are sent after the resume than the file has); the size cap, a hidden source path, a protected
destination (held for a person, then approved by the digest it showed) and a corrupted chunk are refused."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.kits import db as dbkit
from tests.kits.netutil import CLI, Proc, free_port, tether_env, wait_for
from tether.client import Client
from tether.client.rest import RemoteServer
from tether.protocol.models import Command, Result
from tether.server.aip.transfer.model import transfer_id

WAIT = 60.0
# a dropped device's batches wait 3 s for it; silence for 2 s means it is gone
SERVER_TIMING = ["--heartbeat-interval", "0.3", "--heartbeat-timeout", "2", "--grace-period", "3"]


@dbkit.keeps_server_state
class Fleet:
    """A server, devices alpha and beta (each with its own state directory and a policy whose only write
    root is `tmp/work`), and an API token holding every scope."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.work = tmp / "work"
        self.work.mkdir()
        state = tmp / "state"
        state.mkdir()
        self.env = tether_env(state)
        self.token, *devices = dbkit.create_tokens(dbkit.server_db(state / "server.db"), [
            ("api", "mover", ["read", "execute", "approve", "admin"]), ("device", "alpha", []), ("device", "beta", [])])
        self.device_tokens = dict(zip(("alpha", "beta"), devices, strict=True))
        self.policy = tmp / "policy.yaml"
        self.policy.write_text(f"write_roots: [{str(self.work)!r}]\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Proc] = []
        self.devices: dict[str, Proc] = {}
        self.remote = RemoteServer(self.url, self.token)
        self.server = self._start(["server", "--port", str(self.port), *dbkit.server_db_args(state / "server.db"),
                                   *SERVER_TIMING, "--log-level", "warning"], "server")
        wait_for(lambda: self.remote.health()["status"] in ("ok", "degraded"), "server health", WAIT,
                 (self.server.popen,))
        self.client = Client(self.url, self.token, timeout=WAIT)

    def _start(self, args: list[str], label: str, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(args, self.tmp / f"{label}-{len(self.procs)}.log", {**self.env, **(env or {})})
        self.procs.append(proc)
        return proc

    def device(self, name: str) -> Proc:
        proc = self._start(["device", "--server", f"ws://127.0.0.1:{self.port}", "--name", name, "--state-dir",
                            str(self.tmp / f"dev-{name}"), "--policy", str(self.policy)], f"device-{name}",
                           {"TETHER_DEVICE_TOKEN": self.device_tokens[name]})
        self.devices[name] = proc
        wait_for(lambda: any(r["name"] == name and r["status"] in ("online", "busy") for r in self.remote.devices()),
                 f"{name} online", WAIT, (proc.popen, self.server.popen))
        return proc

    def close(self) -> None:
        self.client.close()
        self.remote.close()
        for proc in reversed(self.procs):
            proc.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("transfer"))
    f.device("alpha")
    f.device("beta")
    yield f
    f.close()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): ("dir" if p.is_dir() else _sha(p)) for p in sorted(root.rglob("*"))}


def test_a_directory_travels_with_its_checksums_and_is_undone(fleet: Fleet) -> None:
    src = fleet.work / "build"
    (src / "lib" / "deep").mkdir(parents=True)
    (src / "README").write_text("hello\n")
    (src / "lib" / "blob.bin").write_bytes(os.urandom(1_300_000))  # several chunks
    (src / "lib" / "deep" / "empty").write_bytes(b"")
    (src / "lib" / "deep" / "link").symlink_to("../blob.bin")  # inside the tree: sent as a link
    dest = fleet.work / "deploy"
    out = subprocess.run([*CLI, "cp", f"alpha:{src}", f"beta:{dest}", "--session", "xfer-undo", "--json"],
                         capture_output=True, text=True, timeout=WAIT,
                         env={**fleet.env, "TETHER_SERVER": fleet.url, "TETHER_TOKEN": fleet.token})
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)["result"]
    assert report["files"] == 3 and report["bytes"] == 1_300_006 and report["resumes"] == 0
    assert _tree(dest) == _tree(src)
    assert os.readlink(dest / "lib" / "deep" / "link") == "../blob.bin"
    assert {f["path"]: f["sha256"] for f in report["file_sha256"]}["lib/blob.bin"] == _sha(src / "lib" / "blob.bin")
    assert not list(dest.rglob(".tether-part-*"))
    rows = [r for r in fleet.remote._request("GET", "/audit", params={"limit": 500})["rows"]
            if r["tool_name"] in ("transfer.send", "transfer.receive") and report["transfer_id"] in r["arguments"]]
    assert sorted((r["device"], r["tool_name"], r["status"]) for r in rows) == [
        ("alpha", "transfer.send", "success"), ("beta", "transfer.receive", "success")]
    assert all(report["sha256"] in r["arguments"] and '"bytes": 1300006' in r["arguments"] for r in rows), rows
    # undoing the session on the receiver puts the destination back: it did not exist
    _, [undone] = fleet.remote.run("beta", [Command(tool_name="undo_session", parameters={"session_id": "xfer-undo"},
                                                    approved_by="person")], session_id="xfer-undo")
    assert undone.ok, undone.error
    assert not dest.exists()


def test_a_transfer_resumes_after_the_receiver_is_killed_and_restarted(fleet: Fleet) -> None:
    src = fleet.work / "big.bin"
    src.write_bytes(os.urandom(10 << 20))
    dest = fleet.work / "big-copy.bin"
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(fleet.client.transfer, "alpha", str(src), "beta", str(dest), chunk_bytes=32 << 10)
        # beta's partial file (beside the destination) holding some of it: the transfer is under way
        part = wait_for(lambda: next((p for p in fleet.work.glob(".tether-part-*") if p.stat().st_size >= 256 << 10),
                                     None), "a partial file on beta", WAIT)
        assert isinstance(part, Path)
        fleet.devices["beta"].kill()
        held = part.stat().st_size
        assert held < src.stat().st_size
        fleet.device("beta")  # a new process, same state directory and key
        result: Result = call.result(WAIT)
    assert result.ok, result.error
    report = result.result
    # never sent again from the start: at most the chunks in flight at the kill (8 a batch) go twice
    assert report["bytes_sent"] <= report["bytes"] + (32 << 10) * 8, report
    if report["resumes"]:  # the transfer saw the drop and asked beta what it holds
        assert 0 < report["bytes_sent_after_resume"] < report["bytes"], report
        assert report["bytes_sent_after_resume"] <= report["bytes"] - held + (32 << 10) * 8, report  # its offset
    # else: beta was back within the hub's reconnect grace, and the batch in flight went to the new process,
    # which appended at the partial file's offset (the write refuses any other offset)
    assert _sha(dest) == _sha(src)
    assert not list(fleet.work.glob(".tether-part-*"))
    src.unlink()
    dest.unlink()


def test_more_than_the_size_cap_is_refused_before_a_byte_moves(fleet: Fleet) -> None:
    src = fleet.work / "capped.bin"
    src.write_bytes(b"x" * 10_000)
    dest = fleet.work / "capped-copy.bin"
    result = fleet.client.transfer("alpha", str(src), "beta", str(dest), max_bytes=4096)
    assert not result.ok
    assert "4096-byte transfer cap" in (result.error or ""), result.error
    assert result.result["too_large"] is True
    assert not dest.exists() and not list(fleet.work.glob(".tether-part-*"))


def test_a_hidden_path_is_never_sent_nor_written(fleet: Fleet) -> None:
    result = fleet.client.transfer("alpha", "~/.ssh", "beta", str(fleet.work / "stolen"))
    assert not result.ok
    assert "hide_paths" in (result.error or "") and "alpha" in (result.error or ""), result.error
    assert not (fleet.work / "stolen").exists()
    planted = fleet.work / "authorized_keys"
    planted.write_text("ssh-ed25519 AAAA attacker\n")
    result = fleet.client.transfer("alpha", str(planted), "beta", "~/.ssh/authorized_keys")  # nor created there
    assert not result.ok and "hide_paths" in (result.error or "") and "beta" in (result.error or ""), result.error


def test_a_protected_destination_waits_for_a_person_who_approves_what_was_shown(fleet: Fleet) -> None:
    src = fleet.work / "envrc-source"
    src.write_text("export PATH=/evil:$PATH\n")
    project = fleet.work / "project"
    project.mkdir()
    out = subprocess.run([*CLI, "cp", f"alpha:{src}", f"beta:{project / '.envrc'}", "--json"], capture_output=True,
                         text=True, timeout=WAIT, env={**fleet.env, "TETHER_SERVER": fleet.url,
                                                       "TETHER_TOKEN": fleet.token})
    assert out.returncode == 3, out.stdout + out.stderr  # a person must act
    held = Result.model_validate_json(out.stdout)
    assert not held.ok and held.result["needs_approval"] is True, held
    assert "protected-path" in (held.error or "") and held.result.get("approval_digest"), held
    assert not (project / ".envrc").exists()
    done = fleet.client.transfer("alpha", str(src), "beta", str(project / ".envrc"), approve=True,
                                 approval_digest=held.result["approval_digest"])
    assert done.ok, done.error
    assert (project / ".envrc").read_text() == src.read_text()


def test_a_corrupted_chunk_is_caught_before_the_file_appears(fleet: Fleet) -> None:
    data = os.urandom(100_000)
    sha = hashlib.sha256(data).hexdigest()
    dest = fleet.work / "corrupt.bin"
    tid = "tcorrupt0001"
    entry = {"path": "", "type": "file", "size": len(data), "mode": 0o644, "sha256": sha}
    bad = bytearray(data)
    bad[5000] ^= 0xFF  # one bit pattern flipped on the way
    _, results = fleet.remote.run("beta", [
        Command(tool_name="transfer_begin", parameters={"transfer_id": tid, "dest": str(dest), "kind": "file",
                                                        "name": "corrupt.bin", "entries": [entry]}),
        Command(tool_name="write_file_chunk", parameters={
            "transfer_id": tid, "root": str(dest), "path": "", "index": 0, "offset": 0, "size": len(data),
            "data": base64.b64encode(bytes(bad)).decode()}),
        Command(tool_name="transfer_commit", parameters={"transfer_id": tid, "root": str(dest), "path": "",
                                                         "index": 0, "type": "file", "size": len(data),
                                                         "sha256": sha})], session_id="xfer-corrupt")
    begin, chunk, commit = results
    assert begin.ok and chunk.ok, (begin.error, chunk.error)
    assert not commit.ok and commit.result["checksum_mismatch"] is True, commit
    assert "checksum mismatch" in (commit.error or "")
    assert not dest.exists() and not list(fleet.work.glob(".tether-part-*"))


def test_a_task_step_sends_a_directory_a_person_approves_and_the_task_undo_puts_it_back(fleet: Fleet) -> None:
    src = fleet.work / "site"
    src.mkdir()
    (src / "index.html").write_text("<h1>hi</h1>\n")
    (src / ".envrc").write_text("layout python\n")  # protected: the receiver holds it for a person
    dest = fleet.work / "served"
    plan = [{"skill": "transfer", "device": "beta", "args": {"from": "alpha", "source": str(src), "dest": str(dest)}}]
    task = fleet.remote.create_task("publish the site", plan=plan, device="beta", devices=["alpha"], confirm="never")
    asked = wait_for(lambda: (t := fleet.remote.task(task["id"]))["state"] in ("waiting_for_user", "failed", "done")
                     and t, "the task to ask", WAIT)
    assert isinstance(asked, dict) and asked["state"] == "waiting_for_user", asked.get("error")
    assert not dest.exists()  # nothing was written before the person said yes
    fleet.remote.approve(task["id"], digest=asked["questions"][-1].get("digest"))
    done = wait_for(lambda: (t := fleet.remote.task(task["id"]))["state"] in ("done", "failed", "cancelled") and t,
                    "the task to end", WAIT)
    assert isinstance(done, dict) and done["state"] == "done", done.get("error")
    assert _tree(dest) == _tree(src)
    undone = fleet.remote.undo_task(task["id"])
    assert "beta" in undone["devices"], undone
    assert not dest.exists()


def test_escaping_symlinks_special_files_and_dotdot_names_are_refused(fleet: Fleet) -> None:
    tree = fleet.work / "leaky"
    tree.mkdir()
    (tree / "ok.txt").write_text("fine\n")
    (tree / "out").symlink_to("/etc/hostname")  # leads out of the tree
    result = fleet.client.transfer("alpha", str(tree), "beta", str(fleet.work / "leaky-copy"))
    assert not result.ok and "outside the tree" in (result.error or ""), result.error
    (tree / "out").unlink()
    os.mkfifo(tree / "pipe")
    result = fleet.client.transfer("alpha", str(tree), "beta", str(fleet.work / "leaky-copy"))
    assert not result.ok and "special file (FIFO)" in (result.error or ""), result.error
    assert not (fleet.work / "leaky-copy").exists()
    # a sender (or anyone calling the receiver's tool) naming an entry that climbs out is refused there too
    entry = {"path": "../escaped.txt", "type": "file", "size": 1, "sha256": "0" * 64}
    _, [begin] = fleet.remote.run("beta", [Command(tool_name="transfer_begin", parameters={
        "transfer_id": "tdotdot0001", "dest": str(fleet.work / "inbox"), "kind": "dir", "name": "inbox",
        "entries": [entry]})])
    assert not begin.ok and "refused entry name '../escaped.txt'" in (begin.error or ""), begin.error
    assert not (fleet.work / "inbox").exists() and not (fleet.work / "escaped.txt").exists()


def test_a_symlink_planted_in_the_destination_is_never_written_through(fleet: Fleet) -> None:
    src = fleet.work / "pkg"
    (src / "lib").mkdir(parents=True)
    (src / "lib" / "mod.py").write_text("x = 1\n")
    victim = fleet.work / "victim"
    victim.mkdir()
    trap = fleet.work / "trap"
    (trap / "pkg").mkdir(parents=True)
    (trap / "pkg" / "lib").symlink_to(victim)  # inside the write roots, but not where the names say
    result = fleet.client.transfer("alpha", str(src), "beta", str(trap))
    assert not result.ok and "path.escape" in (result.error or ""), result.error
    assert list(victim.iterdir()) == []


def test_a_partial_file_holding_wrong_bytes_is_caught_and_the_file_sent_again(fleet: Fleet) -> None:
    src = fleet.work / "model.bin"
    src.write_bytes(os.urandom(300_000))
    dest = fleet.work / "model-copy.bin"
    _, [manifest] = fleet.remote.run("alpha", [Command(tool_name="transfer_manifest", parameters={"path": str(src)})])
    tid = transfer_id("alpha", manifest.result["root"], "beta", str(dest), manifest.result["entries"])
    part = fleet.work / f".tether-part-{tid}-0"
    part.write_bytes(b"\0" * 100_000)  # what a corrupted chunk left behind: the receiver reports 100,000 bytes held
    result = fleet.client.transfer("alpha", str(src), "beta", str(dest))
    assert result.ok, result.error
    assert result.result["resent_files"] == 1, result.result  # resumed at 100,000, caught at the commit, sent again
    assert result.result["bytes_sent"] == 200_000 + 300_000, result.result
    assert _sha(dest) == _sha(src) and not part.exists()


def test_a_token_reaches_only_its_devices_and_an_agent_never_approves(fleet: Fleet) -> None:
    src = fleet.work / "scoped.txt"
    src.write_text("data\n")
    made = {name: fleet.remote._request("POST", "/tokens", json={"kind": "api", "name": name, **extra})["token"]
            for name, extra in (("beta-only", {"scopes": ["read", "execute"], "devices": ["beta"]}),
                                ("an-agent", {"scopes": ["read", "execute"], "agent": True}))}
    body = {"source": "alpha", "source_path": str(src), "dest": "beta", "dest_path": str(fleet.work / "scoped-copy")}
    with httpx.Client(base_url=fleet.url + "/api/v1", timeout=WAIT) as http:
        scoped = http.post("/transfers", json=body, headers={"Authorization": f"Bearer {made['beta-only']}"})
        assert scoped.status_code == 404 and "alpha" in scoped.json()["error"], scoped.text  # reads nothing there
        agent = http.post("/transfers", json={**body, "approve": True},
                          headers={"Authorization": f"Bearer {made['an-agent']}"})
        assert agent.status_code == 403 and "agent" in agent.json()["error"], agent.text
    assert not (fleet.work / "scoped-copy").exists()
