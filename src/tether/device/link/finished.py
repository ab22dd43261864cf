"""The record of finished calls on the device.

`FinishedRecord` makes execution exactly-once: a command is answered from the record instead of
being run again when the record holds its batch's `response_id` and its `call_id` (the server
re-sends pending batches, under their own response_id, after a reconnect when it is unsure whether
their results arrived). The `response_id` is the server's own: a fresh one for every batch, never
chosen by whoever asked. A `call_id` may be (a REST caller's label, say `nightly-report-1`), so it
is never an identity on its own: another batch reusing it is a new call, run and answered anew.
"""

from __future__ import annotations

from collections import OrderedDict

from tether.protocol.models import Result

RecordKey = tuple[str, str]  # (the batch's server-issued response_id, the call_id within it)


def record_key(response_id: str | None, call_id: str | None) -> RecordKey | None:
    """The record's key for one call of one batch; None (not recorded) when either id is missing."""
    if not response_id or call_id is None:
        return None
    return response_id, call_id


DEFAULT_RECORD_BYTES = 64 * 1024 * 1024


_SCALAR = frozenset({bool, int, float, type(None)})


def approx_bytes(value: object) -> int:
    """About the JSON size of a result payload, without encoding it (strings by length, containers by
    their parts): what the record holds on to."""
    kind = type(value)
    if kind is dict:  # the common payloads, their plain strings and numbers counted here (no call for each)
        total = 2
        for key, item in value.items():  # type: ignore[attr-defined]
            total += (len(key) + 4) if type(key) is str else approx_bytes(key) + 2
            each = type(item)
            total += len(item) + 2 if each is str else 8 if each in _SCALAR else approx_bytes(item)
        return total
    if kind is list:
        total = 2
        for item in value:  # type: ignore[attr-defined]
            each = type(item)
            total += len(item) + 3 if each is str else 9 if each in _SCALAR else approx_bytes(item) + 1
        return total
    if isinstance(value, str | bytes | bytearray):
        return len(value) + 2
    if isinstance(value, dict):
        return 2 + sum(approx_bytes(k) + approx_bytes(v) + 2 for k, v in value.items())
    if isinstance(value, list | tuple):
        return 2 + sum(approx_bytes(v) + 1 for v in value)
    if value is None or isinstance(value, bool | int | float):
        return 8
    return len(str(value))


def result_bytes(result: Result) -> int:
    """What the record counts a result as holding: its payload's `approx_bytes`, its error, and a fixed overhead."""
    return 64 + approx_bytes(result.result) + len(result.error or "")


class FinishedRecord:
    """The last `limit` finished calls by `record_key`, oldest forgotten first; their full results
    within `max_bytes`.

    Only a resend needs a result again, and the server resends only what it still waits for: the
    latest batches. So when the results held pass `max_bytes`, the oldest lose their payload (never
    their entry: a call stays answered, never run twice) and are answered with their status and an
    error saying the result is no longer held. One result over the whole budget is kept until the
    next one comes, so a resend of the latest batch always gets its results."""

    def __init__(self, limit: int = 10_000, max_bytes: int = DEFAULT_RECORD_BYTES) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.bytes = 0  # the results held in full (stubs are small and counted by `limit`)
        self._results: OrderedDict[object, Result] = OrderedDict()
        self._sizes: OrderedDict[object, int] = OrderedDict()  # the keys still held in full, oldest first

    def __contains__(self, key: object) -> bool:
        return key is not None and key in self._results

    def __len__(self) -> int:
        return len(self._results)

    def get(self, key: object) -> Result | None:
        """The recorded result of `key` (a payload dropped for the budget reads as its stub), or None."""
        return self._results.get(key) if key is not None else None

    def add(self, key: object, result: Result) -> None:
        """Record `result` under `key` (None: not recorded), newest last; past `limit` the oldest entry is
        forgotten, past `max_bytes` the oldest results keep only their outcome."""
        if key is None:
            return
        self._results[key] = result
        self._results.move_to_end(key)
        size = result_bytes(result)
        self.bytes += size - self._sizes.pop(key, 0)
        self._sizes[key] = size
        while len(self._results) > self.limit:
            old, _ = self._results.popitem(last=False)
            self.bytes -= self._sizes.pop(old, 0)
        while self.bytes > self.max_bytes and len(self._sizes) > 1:
            old, size = self._sizes.popitem(last=False)
            self.bytes -= size
            self._results[old] = _without_payload(self._results[old], size)

    def calls(self, call_id: str) -> list[RecordKey]:
        """The keys of the recorded calls with this `call_id`, oldest first (each batch that carried it)."""
        return [k for k in self._results if isinstance(k, tuple) and k[1] == call_id]

    def held(self, key: object) -> bool:
        """Whether the record still holds this call's full result (not only its outcome)."""
        return key in self._sizes


def _without_payload(result: Result, size: int) -> Result:
    return Result(status=result.status, call_id=result.call_id, namespace=result.namespace,
                  error=f"this command already ran ({result.status.value}); its result (about {size} bytes) is "
                        f"no longer held by the device (it keeps only the latest results), so it is not run "
                        f"again{': ' + result.error if result.error else ''}")
