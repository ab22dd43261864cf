"""The `Sandbox`'s layers bookkeeping: handing layers out (primed, pooled or new), releasing and sweeping
them, when each command started, what this device's applies changed, the worker pool and the kept totals."""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tether.sandbox.confine.spec import SandboxUnavailable
from tether.sandbox.layers.layer import discard
from tether.sandbox.runner.empty import layer_empty, remove_all
from tether.sandbox.runner.state import (
    APPLIED_LOG_PATHS,
    FREE_LAYERS,
    MAX_HELD_SINCE,
    SWEEP_BATCH,
    SandboxParts,
    T,
    logger,
)


class LayerBook(SandboxParts):
    """Layers handed out and taken back, and the applies seen."""

    def new_layer(self) -> Path:
        """A fresh directory for one command's overlays: `<n>/u` and `<n>/w` per captured root.

        A layer a command left empty (most commands write nothing) is reused rather than made anew.
        The time it is handed out is the command's start for `layer_since` (what apply compares with).
        """
        if self._primed is not None:
            layer, self._reserved[layer] = self._primed
            self._primed = None
        else:
            layer = self._free.pop() if self._free else self._make_layer()
        self._since[layer] = (time.time_ns(), self._apply_seq)
        if len(self._since) > 4 * MAX_HELD_SINCE:  # held layers that expired were never released: forget them
            for gone in [known for known in self._since if not known.exists()]:
                del self._since[gone]
        return layer

    def _make_layer(self) -> Path:
        Path(self.spec.layers_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
        base = Path(self.spec.layers_dir) / f"L{os.getpid()}-{next(self._layer_ids)}-{os.urandom(4).hex()}"
        base.mkdir(mode=0o700)
        self._own(base)
        for i in range(len(self.spec.write_roots)):
            for sub in (base / str(i), base / str(i) / "u", base / str(i) / "w"):
                sub.mkdir()
                self._own(sub)
        return base

    def _prime(self, layer: Path) -> None:
        """Have the warden make the next command's namespace on the empty `layer` now, between commands
        (warden `_primed`): that command's request then only hands it the program and stdio. A command
        whose mounts differ (another socket list, a changed live root) gets a namespace of its own, as
        before; the primed one is dropped."""
        request_id = next(self._ids)
        try:
            self._send({"op": "prime", "id": request_id, **self._mounts(layer)})
        except (OSError, SandboxUnavailable):
            if len(self._free) < FREE_LAYERS:
                self._free.append(layer)
            return
        self._primed = (layer, request_id)

    def layer_since(self, layer: Path) -> int:
        """When the command writing into `layer` started (wall clock, ns); 0 if unknown."""
        return self._since.get(layer, (0, 0))[0]

    def note_applied(self, paths: Iterable[str], deleted: Iterable[str]) -> None:
        """An apply of this device made changes at `paths` (`deleted`: the ones it removed, trees included).
        Call on the event loop."""
        self._apply_seq += 1
        self._keep_totals()
        entry = (self._apply_seq, frozenset(paths), frozenset(deleted))
        self._applied.append(entry)
        self._applied_paths += len(entry[1])
        while self._applied_paths > APPLIED_LOG_PATHS and self._applied:
            seq, old, _ = self._applied.popleft()
            self._applied_paths -= len(old)
            self._forgotten = seq

    def _keep_totals(self) -> None:
        """Write the sessions' totals to the state directory on the worker pool, one write at a time (a
        change made meanwhile is written once that one ends). Call on the event loop."""
        if self.kept is None or self._closed:
            return
        if self._keeping is not None:
            self._keep_again = True
            return
        self._keeping = self.submit(self.kept.keep_totals, self.sessions.snapshot())

        def done(future: asyncio.Future[None]) -> None:
            self._keeping = None
            if not future.cancelled() and future.exception() is not None:
                logger.warning("could not keep the sessions' totals: %s", future.exception())
            if self._keep_again:
                self._keep_again = False
                self._keep_totals()

        self._keeping.add_done_callback(done)

    def applied_since(self, layer: Path) -> list[tuple[frozenset[str], frozenset[str]]] | None:
        """(paths, deleted) of each apply of this device made after `layer`'s command started; None
        when that is unknown or partly forgotten (ctime alone then tells). Call on the event loop."""
        started = self._since.get(layer)
        if started is None or started[1] < self._forgotten:
            return None
        return [(paths, deleted) for seq, paths, deleted in self._applied if seq > started[1]]

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Start blocking filesystem work (scan, apply, journal) on the sandbox's bounded worker pool."""
        return asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """`submit` and wait for it."""
        return await self.submit(fn, *args)

    def _own(self, path: Path) -> None:
        """A root device's layers belong to its run_as user, whose warden mounts overlays on them (a user
        namespace's capabilities reach only files whose owner it maps); see docs/security/root.md."""
        run_as = self.spec.run_as
        if run_as is not None:
            os.chown(path, run_as.uid, run_as.gid, follow_symlinks=False)

    def layer_empty(self, layer: Path) -> bool:
        """Whether the command that wrote into `layer` left nothing there (`layer_empty`, on the loop: an
        empty layer is one directory read per write root; a written one stops at its first entry)."""
        return layer_empty(layer, self.spec.write_roots, self.spec.hidden)

    def release(self, layer: Path, *, empty: bool = False) -> None:
        """Done with a layer: an empty one goes back to the pool, any other is removed off the hot path.
        `empty`: the caller has just found it empty (`layer_empty`), so it is not read again."""
        self._since.pop(layer, None)
        self._reserved.pop(layer, None)
        if len(self._free) < FREE_LAYERS and (empty or self.layer_empty(layer)):
            if self.prime and self._primed is None and self._sock is not None and not self._closed:
                self._prime(layer)
            else:
                self._free.append(layer)
            return
        if self._closed:
            discard(layer)  # the device is stopping: nothing else to serve
            return
        future = asyncio.get_running_loop().run_in_executor(self._pool, discard, layer)
        self._removing.add(future)
        future.add_done_callback(self._removing.discard)

    def _sweep(self, request_id: int) -> None:
        """The command's namespace is gone: the work directories of its layer's previous use, which it set
        aside (`mounts.set_aside`), are removed in batches off the event loop."""
        layer = self._layer_of.pop(request_id, None)
        if layer is None:
            return
        self._gone += [layer / str(i) / "w" / f"gone-{request_id}" for i in range(len(self.spec.write_roots))]
        if len(self._gone) >= SWEEP_BATCH * len(self.spec.write_roots):
            gone, self._gone = self._gone, []
            future = asyncio.get_running_loop().run_in_executor(None, remove_all, gone)
            self._removing.add(future)
            future.add_done_callback(self._removing.discard)
    def _discard_layers(self) -> None:
        """The layers this device left, but for those held for an approval (they expire on their own)."""
        layers = Path(self.spec.layers_dir)
        if layers.is_dir():
            for layer in layers.glob(f"L{os.getpid()}-*"):
                if not (layer / "held.json").exists():
                    discard(layer)
