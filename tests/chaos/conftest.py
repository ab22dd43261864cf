"""Fixtures of the chaos suite: a killable server, counted commands, and a ledger of what callers got."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.kits.chaos import ChaosCluster, Ledger, Runs


@pytest.fixture
def runs(tmp_path: Path) -> Iterator[Runs]:
    r = Runs(tmp_path)
    yield r
    r.close()


@pytest.fixture
def ledger() -> Ledger:
    return Ledger()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ChaosCluster]:
    c = ChaosCluster(tmp_path)
    yield c
    c.close()


@pytest.fixture
def callers() -> Iterator[ThreadPoolExecutor]:
    """Threads for callers that block on a batch while the test breaks things under them."""
    with ThreadPoolExecutor(4, thread_name_prefix="caller") as pool:
        yield pool
