"""When a device's heartbeat is worth sending.

A heartbeat carries two things: proof that the device is alive (and, by the server's answer, that the
server is), and the device's load — the batches running and queued — which the server uses to pick
devices. Any frame is proof of life to either side, as MQTT's keep-alive counts any packet, so a beat is
news only when the link was quiet in one direction during the last interval or the load changed since
the last beat said it. A fan-out to 10,000 devices is such a busy interval for every one of them: there
the skipped beats and their answers had cost the server and the devices a third as much CPU as the
commands themselves (bench/fleet_fanout.py).
"""

from __future__ import annotations


def beat_due(sent_since_last: bool, heard_ago: float, interval: float, news: tuple[int, int],
             said: tuple[int, int] | None) -> bool:
    """Whether to send the heartbeat due now.

    `sent_since_last`: the device put any frame for the server since the last beat was due;
    `heard_ago`: seconds since the last frame from the server; `news`: (running, queued) now;
    `said`: what the last beat sent told, None before the first."""
    return not sent_since_last or heard_ago >= interval or news != said
