"""Bounded diffs of changed text files (`tether.sandbox.layers.diff`): - and + lines, the caps (64 KiB a
file, 256 KiB a command, sides over 1 MiB never read whole), binary and non-UTF-8 content described,
names that are not UTF-8 escaped, and a real-tree file swapped since the scan never read."""

from __future__ import annotations

import os
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.sandbox.layers.diff import MAX_FILE, PER_COMMAND, PER_FILE, Budget, layer_diffs, read_side, text_diff
from tether.sandbox.layers.layer import Change


def lines(n: int, word: str = "line") -> bytes:
    return "".join(f"{word} {i}\n" for i in range(n)).encode()


def test_an_edit_is_a_unified_diff_with_its_counts() -> None:
    record = text_diff(b"port=80\nhost=a\n", b"port=8080\nhost=a", "/etc/app.conf", Budget())
    assert record == {"diff": "--- a/etc/app.conf\n+++ b/etc/app.conf\n@@ -1,2 +1,2 @@\n-port=80\n-host=a\n"
                              "+port=8080\n+host=a\n\\ No newline at end of file\n", "added": 2, "removed": 2}
    created = text_diff(None, b"new\n", "/w/n.txt", Budget())
    assert created["diff"].startswith("--- /dev/null\n+++ b/w/n.txt\n") and created["added"] == 1
    deleted = text_diff(b"gone\n", None, "/w/n.txt", Budget())
    assert deleted["diff"].endswith("+++ /dev/null\n@@ -1 +0,0 @@\n-gone\n") and deleted["removed"] == 1


def test_binary_non_utf8_and_unread_sides_are_described_never_diffed() -> None:
    assert text_diff(b"a\x00b", b"a", "/f", Budget()) == {"diff_skipped": "binary"}
    assert text_diff(b"a", b"caf\xe9\n", "/f", Budget()) == {"diff_skipped": "not UTF-8"}
    assert text_diff("over 1 MiB", b"a", "/f", Budget()) == {"diff_skipped": "over 1 MiB"}
    name = os.fsdecode(b"/w/caf\xe9.txt")  # a name read from disk that is not UTF-8
    assert "--- a/w/caf\\xe9.txt\n" in text_diff(b"a\n", b"b\n", name, Budget())["diff"]


def test_a_file_s_diff_stops_at_64_kib_and_a_command_s_at_256_kib() -> None:
    budget = Budget()
    big = text_diff(None, lines(20_000), "/w/big", budget)  # 20,000 lines added: about 230 KiB of diff
    assert big["diff_truncated"] is True and big["added"] == 20_000  # counted whole, shown cut
    assert PER_FILE - 40 < len(big["diff"].encode()) <= PER_FILE
    assert big["diff"].splitlines()[-1] == f"+line {len(big['diff'].splitlines()) - 4}"  # whole lines only
    shown = [big] + [text_diff(None, lines(20_000), f"/w/more{i}", budget) for i in range(4)]
    sizes = [len(r.get("diff", "").encode()) for r in shown]
    assert sum(sizes) <= PER_COMMAND and min(sizes[:4]) > PER_FILE - 40 and sizes[4] == 0
    assert shown[4] == {"diff_skipped": "the diffs of this change already hold 256 KiB"}


def test_a_side_over_1_mib_is_not_read_and_a_link_is_not_followed(tmp_path: Path) -> None:
    huge = tmp_path / "huge.log"
    huge.write_bytes(b"x\n" * (MAX_FILE // 2 + 1))
    assert read_side(str(huge)) == "over 1 MiB"
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    (tmp_path / "link").symlink_to(secret)
    assert read_side(str(tmp_path / "link")) == "unreadable"


def test_a_layer_s_modified_file_diffs_the_real_tree_against_the_layer(tmp_path: Path) -> None:
    real, upper = tmp_path / "real", tmp_path / "upper"
    real.mkdir()
    upper.mkdir()
    (real / "app.conf").write_text("port=80\n")
    (upper / "app.conf").write_text("port=8080\n")
    (upper / "new.txt").write_text("hello\n")
    (real / "old.bin").write_bytes(b"\x00\x01")
    st = os.lstat(real / "app.conf")
    changes = [Change(str(real / "old.bin"), "deleted", 2, "file", str(real)),
               Change(str(real / "new.txt"), "created", 6, "file", str(real), source=str(upper / "new.txt")),
               Change(str(real / "app.conf"), "modified", 10, "file", str(real), source=str(upper / "app.conf"),
                      was=(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)),
               Change(str(real / "d"), "created", 0, "dir", str(real))]
    diffs = layer_diffs(changes, readable=lambda p: not p.endswith("new.txt"))
    assert "-port=80\n+port=8080\n" in diffs[2]["diff"]
    assert diffs[1] == {"diff_skipped": "not readable under the policy"}
    assert diffs[0] == {"diff_skipped": "binary"} and 3 not in diffs
    # the real file replaced since the scan (another inode): never read, said so
    (real / "app.conf").unlink()
    (real / "app.conf").write_text("someone else's\n")
    assert layer_diffs(changes[2:3])[0] == {"diff_skipped": "changed meanwhile"}


HUNK = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def patched(a: list[str], diff: str) -> list[str]:
    """`a` with a unified diff applied, every context and removed line checked where its header says."""
    lines, out, pos, i = diff.splitlines(keepends=True)[2:], [], 0, 0
    while i < len(lines):
        m = HUNK.match(lines[i])
        assert m, lines[i]
        start = int(m[1]) - 1 if (m[2] or "1") != "0" else int(m[1])
        out += a[pos:start]
        pos, i = start, i + 1
        while i < len(lines) and not lines[i].startswith("@@"):
            kind, body = lines[i][0], lines[i][1:]
            if kind in " -":
                assert a[pos] == body, (pos, a[pos], body)
                pos += 1
            if kind in " +":
                out.append(body)
            i += 1
    return out + a[pos:]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a\n", "b\n", "c\n", "d\n"]), max_size=60),
       st.lists(st.tuples(st.integers(0, 60), st.sampled_from(["set", "add", "del"]), st.sampled_from(["x\n", "a\n"])),
                max_size=5))
def test_the_common_head_and_tail_left_out_still_give_a_diff_that_patches_exactly(
        a: list[str], edits: list[tuple[int, str, str]]) -> None:
    b = list(a)
    for at, op, line in edits:
        if op == "add":
            b.insert(min(at, len(b)), line)
        elif b:
            if op == "set":
                b[min(at, len(b) - 1)] = line
            else:
                del b[min(at, len(b) - 1)]
    record = text_diff("".join(a).encode(), "".join(b).encode(), "/f", Budget())
    assert patched(a, record["diff"]) == b if a != b else record["diff"] == ""
    assert record["added"] == sum(1 for x in record["diff"].splitlines()[2:] if x.startswith("+"))
