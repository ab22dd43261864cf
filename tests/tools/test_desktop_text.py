"""The desktop tools' pure parts as tables: ui.typeText tokens, press_key names, fuzzy label matching."""

from __future__ import annotations

import pytest

from tether.tools.desktop.keys import Segment, TokenError, normalize_key, parse_typed_text
from tether.tools.desktop.ocr import TextElement, match_score, rank


@pytest.mark.parametrize(("text", "segments"), [
    ("hello", [Segment("text", "hello")]),
    ("hello{TAB}", [Segment("text", "hello"), Segment("key", "Tab")]),
    ("{ENTER}", [Segment("key", "Return")]),
    ("a{ESC}{BACKSPACE}b", [Segment("text", "a"), Segment("key", "Escape"), Segment("key", "BackSpace"),
                            Segment("text", "b")]),
    ("{UP}{DOWN}{LEFT}{RIGHT}", [Segment("key", k) for k in ("Up", "Down", "Left", "Right")]),
    ("{CTRL+C}", [Segment("key", "ctrl+c")]),
    ("{CMD+K}", [Segment("key", "super+k")]),
    ("{cmd+v}", [Segment("key", "super+v")]),
    ("{CTRL+SHIFT+T}", [Segment("key", "ctrl+shift+t")]),
    ("{ALT+F4}", [Segment("key", "alt+F4")]),
    ("{WIN}", [Segment("key", "super")]),
    ("{CTRL++}", [Segment("key", "ctrl+plus")]),
    ("{CTRL+/}", [Segment("key", "ctrl+slash")]),
    ("{{literal}}", [Segment("text", "{literal}")]),
    ("{{ENTER}}", [Segment("text", "{ENTER}")]),
    ("x{{{ENTER}", [Segment("text", "x{"), Segment("key", "Return")]),
    ("Hello world{ENTER}", [Segment("text", "Hello world"), Segment("key", "Return")]),
    ("", []),
])
def test_type_text_tokens(text: str, segments: list[Segment]) -> None:
    assert parse_typed_text(text) == segments


@pytest.mark.parametrize(("text", "message"), [
    ("{FOO}", "unknown key 'FOO'"),
    ("{CTRL+}", "empty key name"),
    ("{}", "empty key name"),
    ("a}b", "lone '}'"),
    ("{ENTER", "never closed"),
    ("{C+X}", "not a modifier"),
    ("{CTRL+NOPE}", "unknown key 'NOPE'"),
])
def test_type_text_bad_tokens(text: str, message: str) -> None:
    with pytest.raises(TokenError, match=message.replace("{", r"\{").replace("}", r"\}")):
        parse_typed_text(text)


@pytest.mark.parametrize(("key", "combo"), [
    ("Enter", "Return"), ("enter", "Return"), ("Tab", "Tab"), ("esc", "Escape"), ("ctrl+c", "ctrl+c"),
    ("Ctrl+Shift+T", "ctrl+shift+t"), ("cmd+k", "super+k"), ("F5", "F5"), ("Page_Down", "Page_Down"), ("a", "a"),
    ("A", "a"), ("+", "plus"),
])
def test_press_key_names(key: str, combo: str) -> None:
    assert normalize_key(key) == combo


@pytest.mark.parametrize(("label", "text", "low", "high"), [
    ("Submit", "Submit", 1.0, 1.0),
    ("submit", " SUBMIT ", 1.0, 1.0),
    ("Submt", "Submit", 0.85, 0.95),
    ("Submit", "Submit form", 0.9, 0.9),  # contained: 0.9 x an exact slice
    ("Nonexistent", "Submit", 0.0, 0.4),
    ("", "Submit", 0.0, 0.0),
])
def test_match_score(label: str, text: str, low: float, high: float) -> None:
    score, _span = match_score(label, text)
    assert low <= score <= high, score


def test_rank_prefers_exact_and_narrows_the_box_of_a_contained_label() -> None:
    line = TextElement("e1", "Submit or go back", {"x": 0, "y": 0, "width": 170, "height": 20}, 0.99)
    exact = TextElement("e2", "Submit", {"x": 300, "y": 0, "width": 60, "height": 20}, 0.9)
    assert [m.element.id for m in rank("Submit", [line, exact])] == ["e2", "e1"]
    [inside] = rank("Submit", [line])
    assert inside.score == pytest.approx(0.9)
    assert inside.box == {"x": 0, "y": 0, "width": 60, "height": 20}  # the word's share of the line
    assert inside.center == (30, 10)  # not the line's centre (85, 10)


def test_rank_joins_words_that_ocr_split() -> None:
    show = TextElement("e1", "Show", {"x": 100, "y": 10, "width": 60, "height": 30}, 0.99)
    later = TextElement("e2", "Later", {"x": 175, "y": 12, "width": 70, "height": 30}, 0.98)
    far = TextElement("e3", "Later", {"x": 900, "y": 10, "width": 70, "height": 30}, 0.99)
    best = rank("Show Later", [show, later, far])[0]
    assert (best.element.id, best.element.text, best.score) == ("e1+e2", "Show Later", 1.0)
    assert best.box == {"x": 100, "y": 10, "width": 145, "height": 32}
    assert all(m.element.id != "e2+e3" for m in rank("Later Later", [show, later, far]))
