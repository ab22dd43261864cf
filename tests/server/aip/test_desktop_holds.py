"""`DesktopHolds`: what a person's hold on a device's desktop refuses and lets through (the whole path,
with a real server, device and browser, is tests/web/test_live_view.py)."""

from __future__ import annotations

import pytest

from tether.server.aip.batches.ledger import TokenRef
from tether.server.aip.desktop_holds import DesktopHeld, DesktopHolds


def test_a_hold_refuses_others_desktop_actions_naming_the_holder_and_ends_with_its_key() -> None:
    holds = DesktopHolds()
    seen: list[dict[str, object]] = []
    remove = holds.watch("alpha", seen.append)
    hold = holds.take("alpha", "ada")
    agent = TokenRef("bot", agent=True)
    why = holds.refusal("alpha", ["screenshot", "click"], agent)
    assert why is not None and "ada" in why and "alpha" in why
    assert holds.refusal("alpha", ["screenshot", "shell.run"], agent) is None  # only desktop actions wait
    assert holds.refusal("beta", ["click"], agent) is None  # another device is not held
    assert holds.refusal("alpha", ["type_text"], TokenRef("ada")) is not None  # the person's token alone is not enough
    assert holds.refusal("alpha", ["type_text"], TokenRef("ada", hold=hold.key)) is None
    with pytest.raises(DesktopHeld, match="held by ada"):
        holds.take("alpha", "bob")
    assert not holds.release("alpha", "a-guessed-key")
    assert holds.release("alpha", hold.key)
    assert holds.refusal("alpha", ["click"], agent) is None
    assert [e["holder"] for e in seen] == ["ada", None]
    remove()
    holds.take("alpha", "bob")
    assert len(seen) == 2  # a removed watcher hears nothing more


def test_a_hold_with_a_ttl_runs_out_unless_kept_and_its_watchers_are_told() -> None:
    now = [100.0]
    holds = DesktopHolds(clock=lambda: now[0])  # the clock the holds are timed by, moved by hand
    seen: list[object] = []
    holds.watch("alpha", lambda e: seen.append(e["holder"]))
    hold = holds.take("alpha", "ada", ttl=30)
    agent = TokenRef("bot", agent=True)
    now[0] += 29
    assert holds.keep("alpha", hold.key) and not holds.keep("alpha", "a-guessed-key")
    now[0] += 29  # 58 s after the take, 29 after the keep: still held
    assert holds.refusal("alpha", ["click"], agent) is not None
    now[0] += 2  # 31 s without a keep (its view's node died): it ends, and says so
    assert holds.refusal("alpha", ["click"], agent) is None
    assert holds.current("alpha") is None and not holds.keep("alpha", hold.key)
    assert seen == ["ada", None]
    assert holds.take("alpha", "bob").ttl is None  # without a ttl a hold lasts until released
    now[0] += 10_000
    assert holds.current("alpha") is not None


def test_the_hold_key_travels_to_the_devices_node_with_the_token() -> None:
    ref = TokenRef("ada", hold="k1")
    assert TokenRef.from_dict(ref.to_dict()) == ref
    assert TokenRef.from_dict(TokenRef("bot", agent=True).to_dict()) == TokenRef("bot", agent=True)
    assert TokenRef.from_dict({"name": "x", "hold": 5}) == TokenRef("x")  # a non-string key is no key
