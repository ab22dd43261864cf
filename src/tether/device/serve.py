"""A device connected to a server, in this process: `open_device` (async) and `serve_device` (blocking).

Both build the whole device as `tether device` runs it — the config's policy and MCP servers, the OS
sandbox (probed once), the device key from the state directory, the policy the server set before
(`remote-policy.json`) — and keep it registered with the server over AIP, reconnecting until stopped:

    async with await open_device("ws://server:8765", token=token) as device:
        ...                                  # registered; the server sends it commands
    serve_device("ws://server:8765", token=token)   # the same until SIGINT / SIGTERM / `stop`

Everything the device is told or asks goes through arguments given here: `on_state` hears the link's
state changes, `on_ready` sees the device built before it connects. External MCP servers' questions and
sampling requests go to the server; external servers start once the device has first registered (or
failed to), and the server hears of each one's tools when it joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

from tether.device.computer import Computer
from tether.device.config import DeviceConfig, aip_url, load_device_config
from tether.device.link.connection import (
    ConnectionState,
    DeviceConnection,
    LinkHooks,
    LinkSettings,
    ServerTrust,
    StateHook,
    make_ssl_context,
)
from tether.device.link.outbox import Outbox
from tether.device.link.trust.device_key import load_device_key
from tether.device.local import (
    API_HOLDER,
    LocalDevice,
    build_device,
    device_state_dir,
    hold_state_dir_if_any,
    resolve_policy,
)
from tether.device.mcp.client.client_caps import MCPClientHooks
from tether.device.mcp.client.elicit import RemoteQuestions, RemoteSampler
from tether.device.policy_overlay import RemotePolicy
from tether.device.probe import collect_profile
from tether.device.root import run_as_for
from tether.errors import DeviceError
from tether.sandbox import SandboxInfo, detect
from tether.tools.policy.model import Policy
from tether.tools.running.sandboxing import follow_network

__all__ = ["DeviceSetupError", "ServedDevice", "open_device", "serve_device"]

STOP_POLL_S = 0.1  # how often `serve_device` looks at a `stop` event set from another thread


class DeviceSetupError(DeviceError, ValueError):
    """The device cannot start as asked: its config, policy, server URLs, TLS settings, key or stored
    server policy is unusable; the message says which and why. Nothing is left running."""


class ServedDevice:
    """A device built in this process with its link to a server (`open_device` starts and returns one).

    `local` is the device (tools, policy, sandbox, MCP servers), `connection` its AIP link, `sandbox` the
    probe of what this machine can confine, `state_lock` the descriptor holding its state directory's lock
    (`hold_state_dir`; None when its caller holds it), given up by `close()`. Use it as an async context
    manager, or call `close()`."""

    def __init__(self, local: LocalDevice, connection: DeviceConnection, sandbox: SandboxInfo, *,
                 state_lock: int | None = None) -> None:
        self.local = local
        self.connection = connection
        self.sandbox = sandbox
        self._state_lock = state_lock
        self._run: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def urls(self) -> list[str]:
        """The server URLs the link tries, in order."""
        return self.connection.servers.urls

    @property
    def registered_as(self) -> str | None:
        """The name the server registered this device under (None until it has)."""
        return self.connection.registered_as

    def start(self) -> None:
        """Start the link (connect, register, serve, reconnect) in a task of the running loop; once only."""
        if self._run is not None:
            raise RuntimeError("this device's link is already started")
        self._run = asyncio.create_task(self.connection.run(), name=f"device link {self.connection.name}")

    async def wait_registered(self, timeout: float | None = None) -> str:
        """Wait until the server has registered the device; its registered name.

        Raises `RegistrationRefused` (a refusal retrying cannot fix) or `RetriesExhausted` when the link
        ends first, `TimeoutError` after `timeout` seconds, RuntimeError when the link is not started."""
        if self._run is None:
            raise RuntimeError("the device's link is not started")
        registered = asyncio.ensure_future(self.connection.connected.wait())
        try:
            done, _ = await asyncio.wait({registered, self._run}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            registered.cancel()
        if self._run in done:
            self._run.result()  # raises what ended the link
            raise DeviceError("the device's link stopped before it registered")
        if not done:
            raise TimeoutError(f"not registered with {', '.join(self.urls)} within {timeout} s")
        return str(self.connection.registered_as)

    def stop(self) -> None:
        """Ask the link to finish (running batches are cancelled, their failures sent if possible)."""
        self.connection.stop()

    async def wait_stopped(self) -> None:
        """Wait until the link has finished (after `stop()`, or a refusal).

        Raises `RegistrationRefused` or `RetriesExhausted` when that is what ended it."""
        if self._run is not None:
            await asyncio.shield(self._run)

    async def close(self) -> None:
        """Stop the link, wait for it, and close the device (its MCP servers and sandbox), then give up its
        state directory's lock; idempotent. Does not raise what ended the link (`wait_stopped` does)."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        try:
            if self._run is not None:
                await asyncio.gather(self._run, return_exceptions=True)
        finally:
            try:
                await self.local.aclose()
            finally:
                if self._state_lock is not None:
                    os.close(self._state_lock)

    async def __aenter__(self) -> ServedDevice:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


async def _build(server_url: str | Sequence[str] | None = None, *, token: str,
                              config: DeviceConfig | str | os.PathLike[str] | None = None, name: str | None = None,
                              policy_path: str | os.PathLike[str] | None = None,
                              state_dir: str | os.PathLike[str] | None = None, ca_file: str | None = None,
                              tls_fingerprint: str | None = None, tags: Sequence[str] = (),
                              secret_files: Sequence[str] = (), settings: LinkSettings = LinkSettings(),
                              on_state: StateHook | None = None, lock_state_dir: bool = True) -> ServedDevice:
    """The device and its link, built but not started (`open_device` documents the arguments).

    Raises `DeviceSetupError` or `StateDirBusy`; nothing is left running or held then."""
    try:
        cfg = config if isinstance(config, DeviceConfig) else load_device_config(config)
        state = device_state_dir(cfg, state_dir)
    except ValueError as exc:
        raise DeviceSetupError(str(exc)) from None
    # before anything in the state directory is read: its key, journal, kept policy and probe are this process's
    held = hold_state_dir_if_any(state, API_HOLDER) if lock_state_dir else None
    try:
        return await _build_held(state, held, cfg, servers=[server_url] if isinstance(server_url, str)
                                 else list(server_url or ()), token=token, name=name, policy_path=policy_path,
                                 state_dir=state_dir, ca_file=ca_file, tls_fingerprint=tls_fingerprint, tags=tags,
                                 secret_files=secret_files, settings=settings, on_state=on_state)
    except BaseException:
        if held is not None:
            os.close(held)
        raise


async def _build_held(state: Path, held: int | None, cfg: DeviceConfig, *, servers: list[str], token: str,
                      name: str | None, policy_path: str | os.PathLike[str] | None,
                      state_dir: str | os.PathLike[str] | None, ca_file: str | None, tls_fingerprint: str | None,
                      tags: Sequence[str], secret_files: Sequence[str], settings: LinkSettings,
                      on_state: StateHook | None) -> ServedDevice:
    """`_build` past the state directory's lock (`held`: its descriptor, handed to the result)."""
    try:
        # the device's key: every registration proves it (tether.protocol.identity); hidden from the sandbox
        key_path = cfg.server.key_path(state, Path(cfg.source).parent if cfg.source else None)
        secrets = list(secret_files)
        if not key_path.resolve().is_relative_to(state.resolve()):  # noqa: ASYNC240 (a few stats, at start)
            secrets.append(str(key_path))  # the state directory is hidden whole; a key elsewhere too
        run_as = run_as_for(cfg)  # a root device probes as its run_as user (tether.device.root)
    except ValueError as exc:
        raise DeviceSetupError(str(exc)) from None
    # one probe process while the rest loads, or its answer kept in the state directory for this boot
    sandbox_probe = asyncio.ensure_future(asyncio.to_thread(detect, state, run_as=run_as))
    # and the key (importing `cryptography` takes a while) while the probe runs
    key_loading = asyncio.ensure_future(asyncio.to_thread(load_device_key, key_path))
    device_name = name or cfg.device.name
    questions = RemoteQuestions()  # an external MCP server's question: an event; the answer comes over AIP
    outbox = Outbox(settings.max_queued_events)
    registered_once = asyncio.Event()  # external MCP servers start then, not while the device registers
    connection: DeviceConnection | None = None  # made below: the callbacks reach it once it exists

    def tools_changed(computer: Computer) -> None:
        if connection is not None:
            connection.profile_changed()

    try:
        urls = [aip_url(each) for each in servers] if servers else cfg.server.ws_urls()
        contexts = [None if tls_fingerprint else make_ssl_context(each, ca_file or cfg.server.ca_file)
                    for each in urls]  # each URL checked; one context serves them all (hosts are checked per link)
        device_policy = resolve_policy(cfg, policy_path)
        sandbox = await sandbox_probe
        device_key = await key_loading
        # declared only when the policy may allow it: the server's LLM answers
        sampler = RemoteSampler(outbox.put_control, device_name) if device_policy.mcp_sampling != "off" else None
        hooks = MCPClientHooks(elicit=questions.elicit, sample=sampler.sample if sampler else None)
        # serving a server: no process starts unconfined unless the policy says require_sandbox: false;
        # registers with its built-in tools; each external MCP server joins when started (a DEVICE_INFO)
        device = build_device(cfg, policy=device_policy, state_dir=state_dir, serving=True, sandbox=sandbox,
                              secrets=secrets, mcp_hooks=hooks, join_external=True, join_after=registered_once,
                              on_tools_changed=tools_changed, policy_path=policy_path)
    except ValueError as exc:
        for pending in (sandbox_probe, key_loading):
            pending.cancel()
        raise DeviceSetupError(str(exc)) from None
    confined = device.context.sandbox
    roots_notices: set[asyncio.Future[None]] = set()

    def policy_changed(changed: Policy) -> None:
        if connection is None:  # the stored policy, loaded below: applied before the link exists
            return
        connection.batches.set_limit(changed.max_concurrent_sessions)
        follow_network(confined, changed)
        notice = asyncio.ensure_future(device.mcp_server_manager.roots_changed(device.context))  # new roots
        roots_notices.add(notice)
        notice.add_done_callback(roots_notices.discard)

    remote_policy = RemotePolicy(device.policy, device.state_dir, on_change=policy_changed)  # `tether policy`
    try:
        remote_policy.load()
    except ValueError as exc:
        await device.aclose()
        raise DeviceSetupError(str(exc)) from None
    follow_network(confined, device.policy)  # a network the server narrowed before this start

    def link_state(state: ConnectionState, link: DeviceConnection) -> None:
        if state in ("registered", "disconnected"):  # registered, or cannot be yet: start them anyway
            registered_once.set()
        if on_state is not None:
            on_state(state, link)

    all_tags = list(dict.fromkeys([*cfg.device.tags, *tags]))
    try:
        connection = DeviceConnection(
            device.client, urls, token, name=device_name, key=device_key, outbox=outbox,
            profile=lambda: collect_profile(device, tags=all_tags, sandbox=confined.kind if confined else "none"),
            trust=ServerTrust(ssl_context=contexts[0], tls_fingerprint=tls_fingerprint),
            settings=replace(settings, max_concurrent_sessions=device.policy.max_concurrent_sessions),
            hooks=LinkHooks(on_state=link_state, policy=remote_policy, questions=questions, sampler=sampler))
    except ValueError as exc:  # a URL it cannot use (mixed ws:// and wss://, a pin without TLS)
        await device.aclose()
        raise DeviceSetupError(str(exc)) from None
    return ServedDevice(device, connection, sandbox, state_lock=held)


async def open_device(server_url: str | Sequence[str] | None = None, *, token: str,
                      config: DeviceConfig | str | os.PathLike[str] | None = None, name: str | None = None,
                      policy_path: str | os.PathLike[str] | None = None,
                      state_dir: str | os.PathLike[str] | None = None, ca_file: str | None = None,
                      tls_fingerprint: str | None = None, tags: Sequence[str] = (), secret_files: Sequence[str] = (),
                      settings: LinkSettings = LinkSettings(), on_state: StateHook | None = None,
                      register_timeout: float | None = 30.0, lock_state_dir: bool = True) -> ServedDevice:
    """Build this machine's device, connect it to a server and wait until it is registered.

    `server_url`: `ws(s)://host:port` (the `/aip` path is added), or a cluster's nodes in the order to
    try them; None: the config's `server.url`. `token`: the device token. `config`: a `DeviceConfig`, a
    config file, or None (the default config file). `name`: the device name the token must match (default
    the config's). `policy_path`: a policy file instead of the config's. `state_dir`: where the device
    keeps its key, journal and the server's policy (default the config's, then $TETHER_STATE_DIR).
    `ca_file`: the CA that signs a wss:// server's certificate; `tls_fingerprint`: trust exactly the
    server certificate with this SHA-256 fingerprint instead. `tags`: added to the config's. `secret_files`:
    more paths the sandbox hides (e.g. the token file). `settings`: the link's retry and buffer settings
    (its `max_concurrent_sessions` is the policy's). `on_state(state, connection)`: hears each link state
    change (`connecting`, `registered`, `disconnected`, `refused`, `stopped`). `register_timeout`: seconds
    to wait for the registration (None: no limit). `lock_state_dir` (default): the state directory's lock
    (`tether.device.local.hold_state_dir`) is taken before anything in it is read and held until the device
    is closed, so that no other tether process (a `tether device`, a local `tether exec`, another API user)
    shares its key, undo journal and sessions' totals; False: the caller holds it already.

    The result is registered and keeps reconnecting until closed: `async with` it, or call `close()`.
    Raises `StateDirBusy` (a `DeviceError` naming the holder's kind and pid) when another process holds the
    state directory, `DeviceSetupError` for unusable settings, `RegistrationRefused` when the server refuses
    the device for good, `RetriesExhausted` after `settings.max_attempts` failures, `TimeoutError` after
    `register_timeout`; the device is closed then."""
    served = await _build(server_url, token=token, config=config, name=name, policy_path=policy_path,
                                       state_dir=state_dir, ca_file=ca_file, tls_fingerprint=tls_fingerprint,
                                       tags=tags, secret_files=secret_files, settings=settings, on_state=on_state,
                                       lock_state_dir=lock_state_dir)
    try:
        served.start()
        await served.wait_registered(register_timeout)
    except BaseException:
        await served.close()
        raise
    return served


def serve_device(server_url: str | Sequence[str] | None = None, *, token: str,
                 config: DeviceConfig | str | os.PathLike[str] | None = None, name: str | None = None,
                 policy_path: str | os.PathLike[str] | None = None, state_dir: str | os.PathLike[str] | None = None,
                 ca_file: str | None = None, tls_fingerprint: str | None = None, tags: Sequence[str] = (),
                 secret_files: Sequence[str] = (), settings: LinkSettings = LinkSettings(),
                 on_state: StateHook | None = None, on_ready: Callable[[ServedDevice], None] | None = None,
                 stop: threading.Event | None = None, handle_signals: bool = True, freeze_gc: bool = False,
                 lock_state_dir: bool = True) -> None:
    """Run this machine's device for a server until stopped; blocks (it runs its own event loop).

    The arguments up to `on_state` are `open_device`'s; it does not wait for a first registration: a
    server that is down is retried until it is up. `on_ready(device)` is called once the device is built,
    before it connects. It stops when `stop` (set from any thread) is set, or on SIGINT / SIGTERM when
    `handle_signals` (only in the main thread), and returns after the device is closed. `freeze_gc`: this
    process is the device (`tether device`): its start-up's objects are frozen at the first registration
    (`freeze_once_registered`). `lock_state_dir`: as `open_device`'s (the state directory is held until the
    device is closed).

    Raises `StateDirBusy` when another process holds the state directory, `DeviceSetupError` for unusable
    settings, `RegistrationRefused` when the server refuses the device for good, `RetriesExhausted` after
    `settings.max_attempts` failed attempts in a row."""
    asyncio.run(_serve(server_url, token=token, config=config, name=name, policy_path=policy_path,
                       state_dir=state_dir, ca_file=ca_file, tls_fingerprint=tls_fingerprint, tags=tags,
                       secret_files=secret_files, settings=settings, on_state=on_state, on_ready=on_ready,
                       stop=stop, handle_signals=handle_signals, freeze_gc=freeze_gc,
                       lock_state_dir=lock_state_dir))


def freeze_once_registered(on_state: StateHook | None) -> StateHook:
    """`on_state` (None: nothing) that also, at the first registration, moves every object alive then (the
    modules, models and tool schemas of the start-up) into the collector's permanent generation
    (`gc.freeze`): the full collections a stream of commands triggers then walk only what came after. For
    a process that is the device (`serve_device`): the freeze is the whole process's."""
    frozen = False

    def hook(state: ConnectionState, link: DeviceConnection) -> None:
        nonlocal frozen
        if state == "registered" and not frozen:
            frozen = True
            gc.freeze()
        if on_state is not None:
            on_state(state, link)

    return hook


async def _serve(server_url: str | Sequence[str] | None, *, on_ready: Callable[[ServedDevice], None] | None,
                 stop: threading.Event | None, handle_signals: bool, freeze_gc: bool, **options: Any) -> None:
    if freeze_gc:
        options["on_state"] = freeze_once_registered(options.get("on_state"))
    served = await _build(server_url, **options)
    finished = threading.Event()
    try:
        if on_ready is not None:
            on_ready(served)
        loop = asyncio.get_running_loop()
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, served.stop)
        if stop is not None:
            threading.Thread(target=_stop_when_set, args=(stop, finished, loop, served), daemon=True,
                             name="tether device stop").start()
        served.start()
        await served.wait_stopped()
    finally:
        finished.set()
        await served.close()


def _stop_when_set(stop: threading.Event, finished: threading.Event, loop: asyncio.AbstractEventLoop,
                   served: ServedDevice) -> None:
    """In a thread of its own: stop `served` once `stop` is set, unless it has finished by then."""
    while not finished.is_set():
        if stop.wait(STOP_POLL_S):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing left to stop
                loop.call_soon_threadsafe(served.stop)
            return
