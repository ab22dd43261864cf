"""`yaml12.where_and_why` tells a YAML error by place and kind, never by the file's text: the parts of PyYAML's
message that come from the file (a tag, an alias, a tag handle, a snippet of the line) are left out."""

from __future__ import annotations

import pytest
import yaml

from tether import yaml12

SECRET = "TOPSECRET"


@pytest.mark.parametrize(("text", "said"), [
    (f"a: !{SECRET} x\n", "line 1, column 4: could not determine a constructor for the tag (not shown)"),
    (f"a: *{SECRET}\n", "line 1, column 4: found undefined alias (not shown)"),
    (f"!{SECRET}!x a\n", "line 1, column 1: while parsing a node, found undefined tag handle (not shown)"),
    (f"a: '{SECRET}\n", "line 2, column 1: while scanning a quoted scalar, found unexpected end of stream"),
    (f"a: 1\n\t{SECRET}: 2\n", "line 2, column 1: while scanning for the next token, found character '\\t' "
                               "that cannot start any token"),
    (f"a: {SECRET}\x00\n", "character 13: a control character YAML does not allow"),
    (f"a: {SECRET}".encode() + b"\xff\n", "character 13: bytes that are not valid utf-8"),
])
def test_errors_name_place_and_kind_only(text: str | bytes, said: str) -> None:
    with pytest.raises(yaml.YAMLError) as raised:
        yaml12.safe_load(text)
    assert SECRET in str(raised.value) or isinstance(text, bytes) or "\x00" in text  # PyYAML's own words show it
    assert yaml12.where_and_why(raised.value) == said
    assert SECRET not in yaml12.where_and_why(raised.value)


def test_a_file_not_utf8_is_told_by_its_byte() -> None:
    with pytest.raises(UnicodeDecodeError) as raised:
        f"{SECRET}".encode().__add__(b"\xff").decode("utf-8")
    assert yaml12.where_and_why(raised.value) == "byte 10: not valid UTF-8"


@pytest.mark.parametrize(("key", "shown"), [("network", "network"), ("mcp-servers", "mcp-servers"), (3, "3"),
                                            (f"root:$6${SECRET}:1:::", "(a key that is no name)"),
                                            ("x" * 41, "(a key that is no name)"), (None, "(a key that is no name)")])
def test_keys_are_shown_only_when_they_are_names(key: object, shown: str) -> None:
    assert yaml12.shown_key(key) == shown


def test_a_servers_policy_change_names_no_unknown_key_that_is_no_name() -> None:
    from tether.tools.policy.overlay import check_overlay

    with pytest.raises(ValueError) as raised:
        check_overlay({f"root:$6${SECRET}:19000:0:99999:7::": None, "netwrk": "off"})
    assert str(raised.value) == "unknown policy setting(s): netwrk, (a key that is no name)"
