"""bench/registration_key.py at its smallest: both servers register every device, and the rows are measured."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `bench` lives at the repo root, beside tests/
    sys.path.insert(0, str(REPO))

from bench import registration_key  # noqa: E402


def test_registration_is_measured_with_and_without_the_key_proof() -> None:
    proof, alone = registration_key.measure(devices=20, rounds=2, concurrency=5)
    assert proof["figure"] == "server CPU per registration, key proof"
    assert proof["measured"] >= 0 and proof["anchor"] is not None and proof["anchor"] >= 0
    assert 0 < alone["measured"] < 50  # ms: one indexed read and one Ed25519 verification
