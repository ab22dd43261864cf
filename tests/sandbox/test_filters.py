"""The pure parts of the IPC wall and the resource limits (tether.sandbox.confine.seccomp,
tether.sandbox.confine.limits) and how the policy feeds them. What they do to a real process is in
tests/attacks/test_no_ipc_out.py and tests/attacks/test_resource_limits.py."""

from __future__ import annotations

import signal
import struct

import pytest

from tether.sandbox.confine.limits import Limits, describe, exceeded, shm_options
from tether.sandbox.confine.seccomp import RET_ALLOW, program
from tether.tools.policy.model import policy_from_mapping
from tether.tools.policy.overlay import check_overlay
from tether.tools.running.sandboxing import sandbox_spec

LIMITS = Limits(memory_mb=64, processes=300, cpu_seconds=2, file_size_mb=1, open_files=32, shm_mb=4)
FORK_TRACEBACK = ("Traceback (most recent call last):\n  File \"<string>\", line 4, in <module>\n    pid = os.fork()\n"
                  "          ^^^^^^^^^\nBlockingIOError: [Errno 11] Resource temporarily unavailable\n")


@pytest.mark.parametrize(("code", "stderr", "cpu", "named"), [
    (0, "MemoryError", None, None),  # a command that succeeded hit nothing
    (-signal.SIGXCPU, "", 2.0, "cpu_seconds"),
    (-signal.SIGKILL, "", 3.01, "cpu_seconds"),
    (-signal.SIGKILL, "", 0.2, None),  # killed, but not for CPU
    (-signal.SIGXFSZ, "", None, "file_size_mb"),
    (1, "OSError: [Errno 27] File too large", None, "file_size_mb"),
    (1, "Traceback ...\nMemoryError\n", None, "memory_mb"),
    (1, "FATAL ERROR: Reached heap limit Allocation failed - JavaScript heap out of memory", None, "memory_mb"),
    (1, FORK_TRACEBACK, None, "processes"),
    (128, "bash: fork: retry: Resource temporarily unavailable", None, "processes"),
    (128, "fatal: unable to create thread: Resource temporarily unavailable", None, "processes"),
    (1, "read: Resource temporarily unavailable", None, None),  # a non-blocking read's EAGAIN is not a limit
    (1, "Traceback ...\n  File \"<string>\", line 5, in <module>\nBlockingIOError: [Errno 11] Resource "
        "temporarily unavailable\n", None, "processes"),  # python -c shows no source line: the exception says it
    (1, "node: EMFILE: too many open files, open 'x'", None, "open_files"),
    (2, "ls: cannot access 'nope': No such file or directory", None, None),
])
def test_the_limit_a_failed_command_ran_into_is_named(code: int, stderr: str, cpu: float | None,
                                                        named: str | None) -> None:
    assert exceeded(LIMITS, code, stderr, cpu) == named


def test_a_limit_that_is_off_is_never_named() -> None:
    assert exceeded(Limits(), 1, "MemoryError") is None
    assert exceeded(Limits(), -signal.SIGXCPU, "") is None
    assert describe(LIMITS, "memory_mb") == "limits.memory_mb (64)"
    assert shm_options(LIMITS) == "size=4m,mode=1777" and shm_options(Limits()).startswith("size=50%")


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize("allow_unix", [False, True])
def test_the_filter_assembles_for_each_machine(machine: str, allow_unix: bool) -> None:
    code = program(machine, allow_unix)
    assert len(code) % 8 == 0 and 10 < len(code) // 8 < 64
    instructions = [struct.unpack("=HBBI", code[i:i + 8]) for i in range(0, len(code), 8)]
    assert instructions[0] == (0x20, 0, 0, 4)  # first: load the architecture
    assert instructions[-1][0] == 0x06 and RET_ALLOW in {k for op, _, _, k in instructions if op == 0x06}
    for pc, (op, jt, jf, _) in enumerate(instructions):  # every jump lands inside the program
        if op & 0x07 == 0x05:
            assert pc + 1 + max(jt, jf) < len(instructions)
    assert program(machine, allow_unix) != program(machine, not allow_unix)


def test_the_policy_feeds_the_sandbox_and_only_the_device_sets_it() -> None:
    policy = policy_from_mapping({"allow_sockets": ["/run/user/1000/bus", "*"], "limits": {"memory_mb": 100}})
    spec = sandbox_spec(policy, layers="/var/tmp/x")
    assert spec.allow_sockets == ("*", "/run/user/1000/bus")
    assert spec.limits.memory_mb == 100 and spec.limits.processes == 1024  # the rest keep their defaults
    default = sandbox_spec(policy_from_mapping({}), layers="/var/tmp/x")
    assert default.allow_sockets == () and default.limits.shm_mb == 512
    assert sandbox_spec(policy_from_mapping({"allow_sockets": ["sandbox"]}), layers="/x").allow_sockets == ("sandbox",)
    with pytest.raises(ValueError, match=r"'docker\.sock' is not a socket path"):
        policy_from_mapping({"allow_sockets": ["docker.sock"]})
    with pytest.raises(ValueError, match=r"unknown key 'limits\.memory'"):
        policy_from_mapping({"limits": {"memory": 1}})
    for setting in ({"allow_sockets": ["*"]}, {"limits": {"memory_mb": 0}}):
        with pytest.raises(ValueError, match="can only be set in the device's own policy file"):
            check_overlay(setting)
