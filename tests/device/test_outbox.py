"""The device's outbox keeps a result until the server acknowledges it (docs/outcomes.md): a written
result is held until the answer to a heartbeat written after it, and goes out again, first and in
order, after a reconnect; a heartbeat's answer acknowledges only what was written before it."""

from __future__ import annotations

from tether.device.link.outbox import Outbox


def _drain(outbox: Outbox) -> list[tuple[str, str]]:
    """Pop every frame and 'write' it, as the connection's sender does."""
    written = []
    while (frame := outbox.pop()) is not None:
        outbox.written(frame)
        written.append((frame[0], frame[1]))
    return written


def test_a_heartbeat_that_overtook_a_result_does_not_acknowledge_it() -> None:
    outbox = Outbox()
    outbox.open(1 << 20)
    outbox.put_result("r1", "c1")
    outbox.put_heartbeat("beat-1")
    outbox.put_result("r2", "c2")
    # control frames go first: the beat is written before both results, so its answer covers neither
    assert _drain(outbox) == [("beat", "beat-1"), ("result", "r1"), ("result", "r2")]
    outbox.heartbeat_answered()
    assert outbox.unacked == 2 and outbox.pending_results == 2 and outbox.pending_call_ids() == ["c1", "c2"]


def test_the_answer_acknowledges_only_what_went_before_its_heartbeat() -> None:
    outbox = Outbox()
    outbox.open(1 << 20)
    outbox.put_result("r1", "c1")
    assert _drain(outbox) == [("result", "r1")]
    outbox.put_heartbeat("beat-1")
    assert _drain(outbox) == [("beat", "beat-1")]
    outbox.put_result("r2", "c2")
    assert _drain(outbox) == [("result", "r2")]
    outbox.heartbeat_answered()
    assert outbox.unacked == 1 and outbox.pending_call_ids() == ["c2"]  # r1 is the server's, r2 not yet
    outbox.heartbeat_answered()  # an answer with no beat of ours outstanding acknowledges nothing
    assert outbox.unacked == 1


def test_after_a_reconnect_what_was_not_acknowledged_goes_out_again_first() -> None:
    outbox = Outbox()
    outbox.open(1 << 20)
    for i in (1, 2):
        outbox.put_result(f"r{i}", f"c{i}")
    assert _drain(outbox) == [("result", "r1"), ("result", "r2")]
    outbox.put_heartbeat("beat-1")
    assert _drain(outbox) == [("beat", "beat-1")]
    outbox.close()  # the link died before the beat's answer came: that answer will never come
    outbox.put_result("r3", "c3")  # finished while away
    outbox.heartbeat_answered()  # an answer on no connection of ours: nothing changes
    assert outbox.pending_call_ids() == ["c1", "c2", "c3"]
    outbox.open(1 << 20)
    assert _drain(outbox) == [("result", "r1"), ("result", "r2"), ("result", "r3")]
    outbox.put_heartbeat("beat-2")
    _drain(outbox)
    outbox.heartbeat_answered()
    assert outbox.unacked == 0 and outbox.pending_results == 0


def test_a_beat_before_the_resent_results_does_not_acknowledge_them() -> None:
    outbox = Outbox()
    outbox.open(1 << 20)
    outbox.put_result("r1", "c1")
    assert _drain(outbox) == [("result", "r1")]
    outbox.close()
    outbox.open(1 << 20)
    outbox.put_heartbeat("beat-1")  # control goes first: written before r1 goes out again
    assert _drain(outbox) == [("beat", "beat-1"), ("result", "r1")]
    outbox.heartbeat_answered()
    assert outbox.unacked == 1  # r1 went after that beat: not acknowledged by its answer
