"""A remote `tether exec` cut short: by Ctrl-C (it says what becomes of the command, and the server did
cancel it), and by its server dying mid-command (it names the batch and how to look its outcome up)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from tests.kits.netutil import CLI, Cluster, wait_for


def test_a_remote_exec_cut_short_names_its_batch(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        alpha = cluster.device("alpha")
        cluster.wait_online("alpha", alpha)
        env = {**cluster.env, "TETHER_SERVER": f"http://127.0.0.1:{cluster.port}",
               "TETHER_TOKEN": cluster.api_token, "NO_COLOR": "1", "COLUMNS": "300"}

        def start(seconds: int) -> subprocess.Popen[str]:
            """`tether exec` of `sleep SECONDS` on alpha, returned once the sleep runs there."""
            proc = subprocess.Popen([*CLI, "exec", "shell.run", "cmd=sleep", f'argv=["{seconds}"]', f"cwd={tmp_path}",
                                     "--device", "alpha"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, text=True, env=env)
            wait_for(lambda: proc.poll() is not None or _sleeping(seconds), "the command running", 60)
            assert proc.poll() is None, proc.communicate()
            return proc

        # Ctrl-C: one line saying the command is cancelled on the device, and it is
        proc = start(61)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, out + err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "cancels the command on device alpha" in lines[0], out + err
        batch_id = lines[0].split("tether batch ")[1].split()[0]
        wait_for(lambda: cluster.remote.batch(batch_id)["state"] == "done", "the batch's end", 60)
        [command] = cluster.remote.batch(batch_id)["commands"]
        assert command["status"] != "success" and "cancelled: the HTTP caller disconnected" in command["error"], command

        # the server dies mid-command: the error names the batch and the command that looks it up
        proc = start(62)
        cluster.server.kill()
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 4, out + err
        assert "lost the connection" in err and "tether batch " in err and "Traceback" not in err, err
    finally:
        cluster.close()


def _sleeping(seconds: int) -> bool:
    """Whether a `sleep SECONDS` process runs on this machine (the device's command, seen from outside)."""
    want = f"sleep\0{seconds}\0".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "cmdline").read_bytes().endswith(want):
                return True
        except OSError:
            continue
    return False
