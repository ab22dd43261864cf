"""`TransferService`: send a file or a directory from one device to another, in chunks, through this server.

    result = await service.transfer(TransferRequest(source="alpha", source_path="/data/out",
                                                    dest="beta", dest_path="/srv/in"), caller)

The steps, each a command on a device (the devices' `transfer` tool set):

1. `transfer_manifest` on the sender: every entry with its size and sha256, under the sender's rules
   (a hidden path is refused there); more than the cap (`transfer_max_bytes`, or the request's own lower
   one) is refused before a byte moves.
2. `transfer_begin` on the receiver: the whole destination judged by the receiver's rules (write roots,
   hidden and protected paths, overwrites), directories made and journaled; it answers how many bytes of
   each file it holds already (a partial file kept across a reconnect), which is where sending resumes.
3. per file: `read_file_chunk` on the sender and `write_file_chunk` on the receiver, chunk by chunk
   (`transfer_chunk_bytes`), up to `GROUP` chunks a batch, the reads at most `WINDOW` batches ahead of the
   writes: the server never holds more than those, whatever the file's size; then `transfer_commit`, which
   verifies the sha256 on the receiver before the file becomes visible. A checksum mismatch sends that file
   once more from the start, then fails.
4. A chunk that fails because a device went away (a dropped link, a restarted process) is not a failure: the
   service waits up to `transfer_resume_wait` for the device to be back, asks the receiver again what it
   holds (step 2), and goes on from there, up to `transfer_resume_attempts` times.

A person's approval (`approved_by`, and the digest they were shown for `transfer_begin`) goes with every
receiver command; `transfer_begin`'s digest covers the destination and every entry's sha256, and each
commit checks its file against that sha256. The transfer's id is derived from what is sent and where, so
asking again (after an approval, or a failure) finds the same partial files and resumes.

Each transfer writes one audit row per side (`transfer.send` on the sender, `transfer.receive` on the
receiver) with its bytes, files, checksum and outcome; see `chunks` for why chunks have no row each.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tether.errors import ServerError
from tether.protocol.models import Command, Result, ResultStatus, new_call_id
from tether.server.aip.batches.dispatcher import WebSocketCommandDispatcher
from tether.server.aip.transfer.chunks import ChunkAudit
from tether.server.aip.transfer.model import Caller, TransferRequest, transfer_id
from tether.server.store.audit import SENT

if TYPE_CHECKING:
    from tether.server.aip.hub import DeviceHub

logger = logging.getLogger(__name__)

GROUP = 8  # chunks a batch at most (fewer when that would come near the frame limit)
WINDOW = 2  # batches of chunks read ahead of the receiver at most: the server holds at most WINDOW + 2 batches
CONTROL_TIMEOUT = 300.0  # a manifest or a commit hashes whole files: a slow disk may take a while
@dataclass
class _Progress:
    bytes_sent: int = 0
    after_resume: int = 0
    resumes: int = 0
    resent_files: int = 0
    skipped_files: int = 0
    started: float = field(default_factory=time.monotonic)


class _Interrupted(ServerError):
    """A device went away mid-transfer (not a refusal): the transfer resumes once it is back."""

    def __init__(self, device: str, why: str) -> None:
        super().__init__(why)
        self.device = device


class _Failed(ServerError):
    """The transfer cannot go on; `result` is what the caller gets."""

    def __init__(self, result: Result) -> None:
        super().__init__(result.error)
        self.result = result


class TransferService:
    """Runs transfers through `hub` with the caps in `settings` (`transfer_*`); one per server, stateless
    between transfers (what a transfer has done lives in the receiver's partial files)."""

    def __init__(self, hub: DeviceHub, settings: Any) -> None:
        self.hub = hub
        self.max_bytes: int = settings.transfer_max_bytes
        self.chunk_bytes: int = settings.transfer_chunk_bytes
        self.resume_attempts: int = settings.transfer_resume_attempts
        self.resume_wait: float = settings.transfer_resume_wait
        self.max_frame_bytes: int = settings.max_frame_bytes

    async def transfer(self, request: TransferRequest, caller: Caller,
                       on_progress: Callable[[dict[str, Any]], None] | None = None) -> Result:
        """Send `request` for `caller`; never raises. Success: a `Result` whose payload says what arrived
        (`transfer_id`, `root`, `files`, `bytes`, `sha256` per file, `bytes_sent`, `bytes_sent_after_resume`,
        `resumes`, `seconds`). Failure: the error names the step, device and reason; a destination that
        needs a person comes back as the receiver's needs-approval result (with its `approval_digest`)."""
        if request.source == request.dest and request.source_path == request.dest_path:
            return Result.failure("transfer: the source and the destination are the same path on the same device")
        run = _Transfer(self, request, caller, on_progress)
        return await run.run()


class _Transfer:
    def __init__(self, service: TransferService, request: TransferRequest, caller: Caller,
                 on_progress: Callable[[dict[str, Any]], None] | None) -> None:
        self.service = service
        self.hub = service.hub
        self.request = request
        self.caller = caller
        self.on_progress = on_progress
        self.cap = min(service.max_bytes, request.max_bytes or service.max_bytes)
        self.chunk = max(4096, min(service.chunk_bytes, request.chunk_bytes or service.chunk_bytes))
        # chunks a batch: a batch of them travels as one frame, which must stay well under the frame limit
        self.group = max(1, min(GROUP, service.max_frame_bytes // 2 // (self.chunk * 4 // 3 + 1024)))
        self.progress = _Progress()
        self.transfer_id = ""
        self.manifest: dict[str, Any] = {}
        self.root = ""
        self.rows: dict[str, str] = {}  # device -> the call id of its audit row
        self.response_id = new_call_id()

    # -- commands ----------------------------------------------------------------------------------------

    def _dispatcher(self, device: str, *, audited: bool) -> WebSocketCommandDispatcher:
        audit = self.hub.store.audit if audited else ChunkAudit(self.hub.store.audit)
        return WebSocketCommandDispatcher(self.hub, audit, device, default_timeout=CONTROL_TIMEOUT,
                                          session_id=self.caller.session_id, requested_by=self.caller.requested_by,
                                          asker=self.caller.asker)

    async def _call(self, device: str, tool: str, params: dict[str, Any], *, audited: bool = True,
                    approved: bool = False, digest: str | None = None, timeout: float = CONTROL_TIMEOUT) -> Result:
        command = Command(tool_name=tool, parameters=params,
                          approved_by=self.caller.approved_by if approved else None,
                          approval_digest=digest if approved else None)
        [result] = await self._dispatcher(device, audited=audited).execute_commands([command], timeout=timeout)
        return result

    def _check(self, device: str, tool: str, result: Result) -> Any:
        """The payload of a success; `_Interrupted` when the device was away, `_Failed` when it refused."""
        if result.ok:
            return result.result
        error = result.error or "no result"
        if result.outcome_pending or not self.hub.connected(device) or "restarted" in error:  # the link's doing
            raise _Interrupted(device, f"{tool} on {device}: {error}")
        if "unknown tool" in error:
            error = f"{error}: device {device} lacks the 'transfer' built-in tool set (its config's builtin list)"
        raise _Failed(result.model_copy(update={"error": f"transfer: {error} (device {device})"}))

    # -- the run -----------------------------------------------------------------------------------------

    async def run(self) -> Result:
        req = self.request
        problem = self.hub.store.audit.problem()
        if problem is not None:
            return Result.failure(f"transfer refused, nothing was sent: {problem}")
        try:
            manifest = await self._call(req.source, "transfer_manifest", {"path": req.source_path,
                                                                           "max_bytes": self.cap})
            self.manifest = self._check(req.source, "transfer_manifest", manifest)
            self.transfer_id = self._id()
            await self._audit_start()
        except (_Failed, _Interrupted) as exc:
            return exc.result if isinstance(exc, _Failed) else Result.failure(f"transfer: {exc}")
        try:
            result = await self._send()
        except _Failed as exc:
            result = exc.result
        except asyncio.CancelledError:
            self.hub.store.audit.done_queued(self._outcomes(Result.failure("transfer cancelled by its caller")))
            raise
        try:
            await self.hub.store.audit.done_grouped(self._outcomes(result))
        except Exception:
            logger.exception("could not write the audit rows of transfer %s", self.transfer_id)
        return result

    def _id(self) -> str:
        req = self.request
        return transfer_id(req.source, self.manifest["root"], req.dest, req.dest_path, self.manifest["entries"])

    async def _send(self) -> Result:
        files = await self._begin(first=True)
        attempt = 0
        while True:
            try:
                for item in files:
                    await self._send_file(item)
                for index, entry in enumerate(self.manifest["entries"]):
                    if entry["type"] == "symlink":  # links last: what they point to is there by now
                        self._check(self.request.dest, "transfer_commit", await self._commit(index, entry))
                break
            except _Interrupted as exc:
                attempt += 1
                if attempt > self.service.resume_attempts:
                    raise _Failed(Result.failure(f"transfer: {exc}; gave up after {attempt - 1} resumes")) from None
                await self._await_device(exc)
                files = await self._resume()
        return self._report()

    async def _begin(self, *, first: bool) -> list[dict[str, Any]]:
        req = self.request
        params = {"transfer_id": self.transfer_id, "dest": self.root if not first else req.dest_path,
                  "kind": self.manifest["kind"], "name": self.manifest["name"], "entries": self.manifest["entries"],
                  "overwrite": req.overwrite, "into": first}
        result = await self._call(req.dest, "transfer_begin", params, approved=True,
                                  digest=self.caller.approval_digest if first else None)
        if not result.ok and isinstance(result.result, dict) and result.result.get("needs_approval"):
            raise _Failed(result.model_copy(update={"error": f"transfer to {req.dest}: {result.error}"}))
        begun = self._check(req.dest, "transfer_begin", result)
        self.root = begun["root"]
        files = [f for f in begun["files"] if not f["done"]]
        if first:
            self.progress.skipped_files = len(begun["files"]) - len(files)
        self._tell("begun", root=self.root, files=len(begun["files"]))
        return files

    async def _await_device(self, exc: _Interrupted) -> None:
        self._tell("interrupted", device=exc.device, reason=str(exc))
        for device in (self.request.dest, self.request.source):
            back = await self.hub.registry.wait_until(lambda d=device: self.hub.connected(d),  # type: ignore[misc]
                                                      self.service.resume_wait)
            if not back:
                raise _Failed(Result.failure(f"transfer: {exc}; device {device} did not come back within "
                                             f"{self.service.resume_wait:g}s (ask again to resume from what "
                                             "arrived)"))

    async def _resume(self) -> list[dict[str, Any]]:
        while True:
            try:
                files = await self._begin(first=False)
            except _Interrupted as exc:  # gone again before it answered
                await self._await_device(exc)
                continue
            self.progress.resumes += 1
            self.progress.after_resume = 0
            self._tell("resumed", files=[{"index": f["index"], "offset": f["have"]} for f in files])
            return files

    async def _send_file(self, item: dict[str, Any]) -> None:
        entry = self.manifest["entries"][item["index"]]
        await self._stream(item["index"], entry, item["have"])
        result = await self._commit(item["index"], entry)
        if result.ok:
            return
        if isinstance(result.result, dict) and result.result.get("checksum_mismatch") and not item.get("again"):
            self.progress.resent_files += 1
            self._tell("checksum_mismatch", path=entry["path"], again=True)
            await self._send_file({**item, "have": 0, "again": True})
            return
        self._check(self.request.dest, "transfer_commit", result)

    async def _commit(self, index: int, entry: dict[str, Any]) -> Result:
        params = {"transfer_id": self.transfer_id, "root": self.root, "index": index, "path": entry["path"],
                  "type": entry["type"], "overwrite": self.request.overwrite}
        if entry["type"] == "file":
            params.update(size=entry["size"], sha256=entry["sha256"], mode=entry.get("mode", 0o644))
        else:
            params["target"] = entry["target"]
        return await self._call(self.request.dest, "transfer_commit", params, approved=True)

    async def _batch(self, device: str, tool: str, params: list[dict[str, Any]], *, approved: bool = False
                     ) -> list[Result]:
        """Several chunk commands as one batch (one round trip), unaudited (`chunks`), stopping at the first
        failure."""
        commands = [Command(tool_name=tool, parameters=p, approved_by=self.caller.approved_by if approved else None)
                    for p in params]
        return await self._dispatcher(device, audited=False).execute_commands(commands, timeout=CONTROL_TIMEOUT)

    async def _stream(self, index: int, entry: dict[str, Any], have: int) -> None:
        """Chunks from `have` to the end: `self.group` chunks a batch (one round trip each way), the reads at
        most one batch ahead of the writes, so the server holds at most WINDOW groups of chunks."""
        if entry["type"] != "file":
            return
        size = entry["size"]
        source_path = self.manifest["root"] if entry["path"] == "" else f"{self.manifest['root']}/{entry['path']}"
        queue: asyncio.Queue[list[tuple[int, str]] | None] = asyncio.Queue(maxsize=WINDOW)

        async def read() -> None:
            offset = have
            while offset < size:
                wanted = [{"path": source_path, "offset": at, "length": self.chunk, "size": size}
                          for at in range(offset, min(size, offset + self.group * self.chunk), self.chunk)]
                group: list[tuple[int, str]] = []
                for result in await self._batch(self.request.source, "read_file_chunk", wanted):
                    got = self._check(self.request.source, "read_file_chunk", result)
                    if got["offset"] != offset:  # an earlier read came back shorter (the sender's cap): go on
                        break                     # from where it ended, in chunks of that size
                    group.append((offset, got["data"]))
                    offset += got["length"]
                    if got["length"] < self.chunk and offset < size:
                        self.chunk = got["length"]
                await queue.put(group)
            await queue.put(None)

        reader = asyncio.create_task(read(), name=f"transfer-read-{self.transfer_id}")
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    reader.result()  # raises what stopped the reader
                    getter = asyncio.ensure_future(queue.get())  # it finished: the rest is queued
                group = await getter
                if group is None:
                    break
                results = await self._batch(self.request.dest, "write_file_chunk", [{
                    "transfer_id": self.transfer_id, "root": self.root, "path": entry["path"], "index": index,
                    "offset": offset, "size": size, "data": data} for offset, data in group], approved=True)
                held = 0
                for (offset, _), result in zip(group, results, strict=True):
                    held = self._check(self.request.dest, "write_file_chunk", result)["have"]
                    self.progress.bytes_sent += held - offset
                    self.progress.after_resume += held - offset
                self._tell("chunk", path=entry["path"], have=held, size=size)
        finally:
            if not reader.done():
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)

    # -- what is told ----------------------------------------------------------------------------------------

    def _tell(self, kind: str, **data: Any) -> None:
        if self.on_progress is not None:
            try:
                self.on_progress({"kind": kind, "transfer_id": self.transfer_id, **data})
            except Exception:
                logger.exception("transfer progress listener failed")

    def _checksum(self) -> str:
        """A file's sha256, or for a directory the sha256 of its manifest (every entry's path, size, sha256)."""
        entries = self.manifest["entries"]
        if self.manifest["kind"] == "file":
            return str(entries[0]["sha256"])
        return "manifest:" + hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":"))
                                            .encode()).hexdigest()

    def _report(self) -> Result:
        seconds = time.monotonic() - self.progress.started
        total = self.manifest["total_bytes"]
        files = [{"path": e["path"], "size": e["size"], "sha256": e["sha256"]}
                 for e in self.manifest["entries"] if e["type"] == "file"]
        payload = {"transfer_id": self.transfer_id, "source": self.request.source,
                   "source_path": self.manifest["root"], "dest": self.request.dest, "root": self.root,
                   "kind": self.manifest["kind"], "files": len(files), "entries": len(self.manifest["entries"]),
                   "bytes": total, "sha256": self._checksum(), "file_sha256": files[:1000],
                   "bytes_sent": self.progress.bytes_sent, "bytes_sent_after_resume": self.progress.after_resume,
                   "resumes": self.progress.resumes, "resent_files": self.progress.resent_files,
                   "skipped_files": self.progress.skipped_files, "seconds": round(seconds, 3),
                   "mib_per_s": round(self.progress.bytes_sent / (1 << 20) / seconds, 1) if seconds > 0 else None}
        return Result(status=ResultStatus.SUCCESS, result=payload)

    # -- the audit ---------------------------------------------------------------------------------------------

    async def _audit_start(self) -> None:
        """One row per side, before anything is written to the receiver: a transfer nobody can audit is not run."""
        req = self.request
        facts = {"transfer_id": self.transfer_id, "source": f"{req.source}:{self.manifest['root']}",
                 "dest": f"{req.dest}:{req.dest_path}", "bytes": self.manifest["total_bytes"],
                 "files": self.manifest["files"], "sha256": self._checksum(), "overwrite": req.overwrite}
        rows = []
        for device, tool in ((req.source, "transfer.send"), (req.dest, "transfer.receive")):
            call_id = self.rows[device + tool] = new_call_id()
            rows.append((self.caller.requested_by, device, call_id, tool, facts, SENT, None, self.response_id,
                         self.caller.approved_by if tool == "transfer.receive" else None))
        problem = await self.hub.store.audit.sent_grouped(rows)  # off the loop's path, with other batches' rows
        if problem is not None:
            raise _Failed(Result.failure(f"transfer refused, nothing was sent: {problem}"))

    def _outcomes(self, result: Result) -> list[tuple[str, str | None, str, str | None]]:
        """The outcome of each side's row: the transfer's status and the reason, or what was verified."""
        status = result.status.value
        note = result.error
        if result.ok:
            note = (f"verified: {self.manifest['files']} file(s), {self.manifest['total_bytes']} bytes, "
                    f"{self.progress.bytes_sent} sent, {self.progress.resumes} resume(s), root {self.root}")
        return [(self.response_id, call_id, status, note) for call_id in self.rows.values()]
