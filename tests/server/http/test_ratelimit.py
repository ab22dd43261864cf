"""The edge's building blocks on their own: token buckets on a clock the test turns, Origin parsing, the
escaping every CLI view prints through."""

from __future__ import annotations

import io

import pytest

from tether.cli.views.safe_text import SafeConsole, visible
from tether.server.http.edge import ConnectionCaps, is_loopback_address
from tether.server.http.ratelimit import NO_SUCH_CLAIM, TokenBuckets, claim_refusal
from tether.server.settings import ServerSettings, format_origin, parse_origin


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_spends_its_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    buckets = TokenBuckets(3, 0.5, clock=clock)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == pytest.approx(2.0)  # one token every 2 s
    assert buckets.take("b") == 0.0  # another key has its own
    clock.now += 2.0
    assert buckets.wait("a") == 0.0 and buckets.take("a") == 0.0 and buckets.wait("a") > 0
    clock.now += 60
    assert buckets.wait("a") == 0.0 and len(buckets) == 1  # full again: forgotten


def test_made_up_keys_cannot_grow_the_table_without_bound() -> None:
    clock = Clock()
    buckets = TokenBuckets(5, 0.001, max_keys=100, clock=clock)
    for n in range(1000):
        buckets.take(f"10.0.{n // 256}.{n % 256}")
    assert len(buckets) <= 100


def test_an_unknown_code_and_a_wrong_key_are_one_answer_and_other_refusals_pass() -> None:
    assert claim_refusal(404, "no pairing request with code ABCD") == (404, NO_SUCH_CLAIM)
    assert claim_refusal(403, "this pairing code belongs to another device") == (404, NO_SUCH_CLAIM)
    assert claim_refusal(403, "an admin refused this device") == (403, "an admin refused this device")


@pytest.mark.parametrize(("text", "parsed"), [
    ("http://localhost:8765", ("http", "localhost", 8765)), ("https://a.example", ("https", "a.example", 443)),
    ("https://A.Example.:443/", ("https", "a.example", 443)), ("http://[::1]:80", ("http", "::1", 80)),
    ("wss://h:1", ("https", "h", 1)), ("null", None), ("http://u@h", None), ("http://h:x", None),
    ("http://h/path", None), ("ftp://h", None), ("http://h:70000", None)])
def test_origins_are_parsed_with_default_ports_filled_in(text: str, parsed: tuple[str, str, int] | None) -> None:
    assert parse_origin(text) == parsed
    if parsed is not None:
        assert parse_origin(format_origin(parsed)) == parsed


def test_caps_count_per_address_and_all_together() -> None:
    caps = ConnectionCaps(ServerSettings(max_connections_per_address=2, max_connections=3), open_files=1024)
    assert caps.http_cap_loopback == 512 and is_loopback_address("127.0.0.9") and is_loopback_address("::1")
    assert [caps.admit_http("10.0.0.1") for _ in range(3)] == [True, True, False]
    assert caps.admit_http("10.0.0.2") and not caps.admit_http("10.0.0.3")  # all together: 3
    caps.release_http("10.0.0.1")
    assert caps.admit_http("10.0.0.3")
    assert caps.admit_socket("10.0.0.1") and caps.sockets == {"10.0.0.1": 1}


def test_the_console_shows_control_characters_and_keeps_lines() -> None:
    assert visible("a\x1b[2J\r\x9b\u202eb\n\tc") == "a\\x1b[2J\\r\\x9b\\u202eb\n\tc"
    assert visible("a\nb", one_line=True) == "a\\nb"
    out = io.StringIO()
    SafeConsole(file=out, width=200, highlight=False, color_system=None).print("x\x1b]0;t\x07 [b]y[/b]")
    assert out.getvalue() == "x\\x1b]0;t\\x07 y\n"
