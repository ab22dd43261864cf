"""Every example of docs/python-api.md runs as written, against a real agent server with a real device."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.kits.task import AgentServer
from tether.tools.policy.model import default_policy

DOC = Path(__file__).resolve().parents[2] / "docs" / "python-api.md"
BLOCK = re.compile(r"(<!-- not run[^>]*-->\n)?```python\n(.*?)```", re.S)


def examples() -> list[str]:
    """The doc's Python blocks, less those marked `<!-- not run ... -->`."""
    return [code for skip, code in BLOCK.findall(DOC.read_text()) if not skip]


def test_the_doc_has_examples() -> None:
    assert len(examples()) >= 8


async def test_every_example_runs(tmp_path: Path) -> None:
    policy = default_policy().model_copy(update={"read_roots": ["/"], "write_roots": [str(tmp_path), "/tmp"]})
    async with AgentServer(tmp_path) as server:
        await server.add_device("alpha", policy, tmp_path / "state-alpha")
        token = server.store.tokens.create("api", "docs", ["read", "execute", "approve", "admin"])[1]
        env = {**os.environ, "TETHER_SERVER": f"http://127.0.0.1:{server.port}", "TETHER_TOKEN": token,
               "TMPDIR": str(tmp_path)}
        for code in examples():
            ran = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code], capture_output=True,
                                          text=True, env=env, timeout=120)
            assert ran.returncode == 0, f"{code}\n--- stdout\n{ran.stdout}\n--- stderr\n{ran.stderr}"
