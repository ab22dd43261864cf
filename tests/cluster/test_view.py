"""The stored device sets (server/cluster/view.py) on a real redis-server: what a node writes, how
another finds that its view differs, and how a set lost with its lease (a stalled node, Redis restarted
empty) is noticed by its writer."""

from __future__ import annotations

from typing import Any

from tether.server.cluster.directory import Directory
from tether.server.cluster.view import HeldSets, digest, digest_key, held_key


def test_the_digest_is_of_the_set_not_its_order() -> None:
    assert digest(["b", "a"]) == digest({"a", "b"}) != digest(["a"])
    assert digest(()).startswith("0:")


async def test_a_reader_finds_only_the_nodes_whose_sets_differ_from_its_view(redis_client: Any) -> None:
    b, c, a = (HeldSets(redis_client, node, 10_000) for node in ("b", "c", "a"))
    assert await b.store({"laptop", "desk"}) is False  # the first write: nothing vanished
    assert await c.store(set()) is False
    shown = {"b": digest({"laptop", "desk"})}  # a shows b right, and nothing at c (right too)
    assert await a.differing(shown, ["b", "c", "d"]) == []  # d has no stored set: left out
    assert await a.differing({"b": digest({"laptop"})}, ["b", "c"]) == ["b"]
    assert await a.members("b") == {"laptop", "desk"}
    await redis_client.set(Directory.device_key("laptop"), "b")
    assert await a.owners(["laptop", "phone"]) == {"laptop": "b", "phone": None}


async def test_a_set_lost_with_its_lease_is_written_again_and_reported(redis_client: Any) -> None:
    b = HeldSets(redis_client, "b", 10_000)
    assert await b.store({"laptop"}) is False
    assert await b.store({"laptop"}) is False  # unchanged: only the leases renewed
    assert 0 < await redis_client.pttl(digest_key("b")) <= 10_000
    await redis_client.delete(held_key("b"), digest_key("b"))  # expired while b was stopped
    assert await b.store({"laptop"}) is True  # b must announce its devices again
    assert await redis_client.smembers(held_key("b")) == {b"laptop"}
    assert await b.store({"laptop", "desk"}) is False  # a change is a rewrite, not a loss
    assert await redis_client.smembers(held_key("b")) == {b"laptop", b"desk"}
    assert await redis_client.get(digest_key("b")) == digest({"laptop", "desk"}).encode()
    assert await b.store(set()) is False
    assert await redis_client.exists(held_key("b")) == 0 and await HeldSets(redis_client, "a", 1).members("b") == set()
