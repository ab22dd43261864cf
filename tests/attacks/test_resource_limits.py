"""Issue 26, item 5: a sandboxed command cannot take the device's resources. A fork bomb, a memory hog, a
CPU spinner and an oversized file each stop at the policy's limit, the result names the limit, nothing the
command wrote is applied, and the device answers the next command at once. `/dev/shm` is the command's
own: what one command leaves there, the next (or another session) does not see, and it never reaches
the machine's.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from tests.kits.confined_device import (  # noqa: F401 (fixtures)
    Attacker,
    attacker_factory,
    home,
    outside,
    run_unprivileged,
    stdout,
    text,
)
from tether.protocol.models import ResultStatus

SMALL = {"processes": 300, "memory_mb": 256, "cpu_seconds": 1, "file_size_mb": 1, "open_files": 64, "shm_mb": 4}


async def _device(attacker_factory) -> Attacker:  # noqa: F811
    return await attacker_factory(allow_inline_code=True, limits=SMALL)


async def _answers_at_once(attacker: Attacker) -> None:
    started = time.monotonic()
    after = await attacker.run("echo", "still here", session="other")
    assert after.ok and stdout(after) == "still here\n", text(after)
    assert time.monotonic() - started < 5, "the device was slow to answer after the limit"


def _stopped_at(result: object, limit: str) -> None:
    assert result.status is ResultStatus.FAILURE, text(result)  # type: ignore[attr-defined]
    assert f"limits.{limit}" in (result.error or ""), text(result)  # type: ignore[attr-defined]
    assert result.result["limit"] == limit, text(result)  # type: ignore[attr-defined]


async def test_a_fork_bomb_stops_at_the_process_limit(attacker_factory, home: Path) -> None:  # noqa: F811
    attacker = await _device(attacker_factory)
    marker = home / f"bomb-{secrets.token_hex(4)}"
    result = await attacker.python(f"""
import os, signal
open({str(marker)!r}, "w").write("written before the bomb")
while True:  # every process forks on until the kernel refuses; then the first one gives up
    pid = os.fork()
    if pid == 0:
        continue
    if os.getpid() != 1:
        signal.pause()
""")
    _stopped_at(result, "processes")
    assert not marker.exists(), "a command stopped by a limit had its writes applied"
    await _answers_at_once(attacker)


async def test_a_memory_hog_stops_at_the_memory_limit(attacker_factory) -> None:  # noqa: F811
    attacker = await _device(attacker_factory)
    result = await attacker.python("hog = [bytearray(16 << 20) for _ in range(64)]  # 1 GiB, touched")
    _stopped_at(result, "memory_mb")
    await _answers_at_once(attacker)


async def test_a_cpu_spinner_stops_at_the_cpu_limit(attacker_factory) -> None:  # noqa: F811
    attacker = await _device(attacker_factory)
    result = await attacker.python("while True: pass", timeoutMs=30_000)
    _stopped_at(result, "cpu_seconds")  # SIGXCPU; one that ignores it gets SIGKILL a few CPU seconds later
    await _answers_at_once(attacker)


async def test_an_oversized_file_stops_at_the_file_size_limit_and_is_not_applied(
        attacker_factory, home: Path) -> None:  # noqa: F811
    attacker = await _device(attacker_factory)
    big = home / "big.bin"
    result = await attacker.python(f"open({str(big)!r}, 'wb').write(b'x' * (3 << 20))")
    _stopped_at(result, "file_size_mb")
    assert not big.exists()


async def test_dev_shm_is_the_command_s_own(attacker_factory) -> None:  # noqa: F811
    attacker = await _device(attacker_factory)
    name = f"tether-shm-{secrets.token_hex(4)}"
    wrote = await attacker.python(f"""
import os
open('/dev/shm/{name}', 'w').write('left behind')
print(sorted(os.listdir('/dev/shm')), os.statvfs('/dev/shm').f_blocks * os.statvfs('/dev/shm').f_frsize >> 20)
""")
    assert wrote.ok and stdout(wrote) == f"['{name}'] 4\n", text(wrote)
    assert not os.path.lexists(f"/dev/shm/{name}"), "/dev/shm inside the sandbox is the machine's"
    for session in ("attack", "another-session"):
        seen = await attacker.python("import os; print(sorted(os.listdir('/dev/shm')))", session=session)
        assert seen.ok and stdout(seen) == "[]\n", text(seen)
    full = await attacker.python("for i in range(16): open(f'/dev/shm/fill{i}', 'wb').write(b'x' * (512 << 10))")
    assert full.status is ResultStatus.FAILURE and "No space left on device" in text(full), text(full)


UNPRIVILEGED = r'''
import asyncio, json, os, shutil, tempfile
from pathlib import Path

from tether.device.local import build_device
from tether.protocol.models import Command
from tether.tools.policy.model import policy_from_mapping

home = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="tether-sbx-home-"))
os.environ["HOME"] = str(home)
report = {"uid": os.getuid()}
BOMB = """
import os, signal
while True:
    pid = os.fork()
    if pid == 0:
        continue
    if os.getpid() != 1:
        signal.pause()
"""
UNIX = """
import errno, socket
try:
    socket.socket(socket.AF_UNIX).connect(%r)
    print("reached")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


async def main():
    sock = home / "api.sock"
    server = await asyncio.start_unix_server(lambda r, w: w.close(), path=str(sock))
    policy = policy_from_mapping({"allow_inline_code": True, "limits": LIMITS})
    device = build_device(policy=policy, state_dir=home / ".state", sandbox=True)
    try:
        await device.computer_manager.get_or_create(None)
        d = device.dispatcher(session_id="sbx")

        async def py(code):
            [r] = await d.execute_commands([Command(tool_name="shell.run", parameters={
                "cmd": "/usr/bin/python3", "argv": ["-c", code], "cwd": str(home)})])
            return {"ok": r.ok, "error": r.error or "", "stdout": (r.result or {}).get("stdout", ""),
                    "limit": (r.result or {}).get("limit")}

        report["sandbox"] = device.context.sandbox.kind if device.context.sandbox else None
        report["unix"] = await py(UNIX % str(sock))
        report["bomb"] = await py(BOMB)
        report["hog"] = await py("hog = [bytearray(16 << 20) for _ in range(64)]")
        report["shm_write"] = await py("open('/dev/shm/left', 'w').write('x')")
        report["shm_next"] = await py("import os; print(os.listdir('/dev/shm'))")
    finally:
        await device.aclose()
        server.close()

try:
    asyncio.run(main())
finally:
    shutil.rmtree(home, ignore_errors=True)
print("REPORT " + json.dumps(report))
'''


def test_the_limits_and_the_ipc_wall_hold_for_an_ordinary_user() -> None:
    """The same attacks from a device run by an ordinary user (not root: no RLIMIT_NPROC exemption to
    lean on, an unprivileged user namespace): refused, with the limit named."""
    report = run_unprivileged(UNPRIVILEGED.replace("LIMITS", repr(SMALL)))
    assert report["sandbox"] and report["sandbox"].startswith("bwrap"), report
    assert report["unix"]["stdout"] == "EPERM\n", report["unix"]
    assert not report["bomb"]["ok"] and report["bomb"]["limit"] == "processes", report["bomb"]
    assert not report["hog"]["ok"] and report["hog"]["limit"] == "memory_mb", report["hog"]
    assert report["shm_write"]["ok"] and report["shm_next"]["stdout"] == "[]\n", report
