"""The built-in tool sets' names known without importing them (`tether.tools.toolsets.builtin.BUILTIN_TOOLS`) are
the sets' own, and `sets_not_holding` leaves out exactly the built-in sets that cannot hold a tool (issue 33 item 4: a
one-off `tether exec` starts only those that can)."""

from __future__ import annotations

import pytest

from tether.tools.errors import MissingDependency
from tether.tools.toolsets.builtin import BUILTIN_TOOLS, OPTIONAL_SETS, builtin_toolsets, sets_not_holding


@pytest.mark.parametrize("name", sorted(builtin_toolsets()))
def test_the_table_names_every_tool_of_each_set(name: str) -> None:
    try:
        toolset = builtin_toolsets()[name]()
    except MissingDependency:
        assert name in OPTIONAL_SETS  # desktop without a display here: tests/tools/test_desktop.py checks it
        return
    assert sorted(toolset.specs) == sorted(BUILTIN_TOOLS[name])


SETS = [("a", "shell", "shell"), ("b", "files", "files"), ("c", "system", "system"), ("d", "files", "f2"),
        ("e", None, "time"), ("f", "nosuch", "odd")]


def test_only_the_sets_that_cannot_hold_the_tool_are_left_out() -> None:
    assert sets_not_holding("get_system_info", SETS) == {"a", "b", "d"}
    assert sets_not_holding("read_file", SETS) == {"a", "c"}  # both sets of files: the first keeps the name
    assert sets_not_holding("f2/read_file", SETS) == {"a", "b", "c"}  # namespace/name: that set
    assert sets_not_holding("shell.run", SETS) == {"b", "c", "d"}  # external and unknown sets are never left out


@pytest.mark.parametrize("tool", [None, "list_tools", "end_session", "get_current_time", "nosuch", "odd/x",
                                  "shell/read_file"])
def test_a_tool_no_built_in_set_is_known_to_hold_starts_everything(tool: str | None) -> None:
    assert sets_not_holding(tool, SETS) == set()
