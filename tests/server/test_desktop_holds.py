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
