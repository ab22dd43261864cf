"""The `Sandbox`'s egress side: changing its network, the proxy's environment, owners and asks."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from tether.sandbox.egress.owner import command_holding
from tether.sandbox.egress.proxy import Answer, EgressProxy, EgressRecord
from tether.sandbox.egress.rules import EgressRules
from tether.sandbox.runner.state import (
    PROXY_ENV,
    SandboxParts,
    egress_log,
)


class EgressSide(SandboxParts):
    """The egress proxy's hooks into the sandbox, and a changed network."""

    def renetwork(self, network: bool, egress: EgressRules | None) -> None:
        """Follow a changed `network` setting (a server narrowed it, or its change was withdrawn).

        Where the sandbox already has the egress proxy and keeps having no direct network, the new rules
        replace the proxy's at once (off: rules that open nothing): the next connection is judged by
        them, and nothing restarts. Going from direct network to none (or back) needs a new network
        namespace: the warden is restarted on the next command, and the commands running in the old
        one end now (a narrower network applies at once).
        """
        if egress is not None and network:
            raise ValueError("an egress proxy needs a sandbox without direct network (network=False)")
        if self.egress is not None and not network and not self.spec.network:
            self.egress.rules = egress or EgressRules()
            return
        if network == self.spec.network and (egress is None) == (self.egress is None):
            return
        old = self.egress
        self.spec = dataclasses.replace(self.spec, network=network)
        self.egress = None if egress is None else EgressProxy(egress, audit=self._on_connection,
                                                               owner=self._owner_of, ask=self._ask_for)
        self._drop_warden("the sandbox restarted: its network policy changed")
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if old is not None:
            closing = asyncio.get_running_loop().create_task(old.aclose())
            self._removing.add(closing)
            closing.add_done_callback(self._removing.discard)

    def proxy_env(self) -> dict[str, str]:
        """What a command's environment gets so that its HTTP and SOCKS clients use the egress proxy."""
        if self._proxy_port is None:
            return {}
        http = f"http://127.0.0.1:{self._proxy_port}"
        return {**{k: http for k in PROXY_ENV if "all" not in k.lower()},
                "ALL_PROXY": f"socks5h://127.0.0.1:{self._proxy_port}",
                "all_proxy": f"socks5h://127.0.0.1:{self._proxy_port}"}

    async def _ask_for(self, host: str, port: int, owner: int | None) -> Answer | None:
        """`ask: on-miss`: the command's own asker (spawn's `ask`), else the sandbox's; None: nobody to ask."""
        ask = self._askers.get(owner) if owner is not None else None
        ask = ask or self._ask
        return None if ask is None else await ask(host, port, owner)

    def _on_connection(self, record: EgressRecord, event: str) -> None:
        """The audit of one proxied connection: the device's log, the command's notes, the `audit` hook."""
        if event == "open":
            if record.owner is not None and record.owner in self._waiters:
                self._connections.setdefault(record.owner, []).append(record)
            if not record.allowed:
                egress_log.warning("%s", record.describe())
        elif record.allowed:
            egress_log.info("%s", record.describe())
        if self._audit is not None:
            self._audit(record, event)

    async def _owner_of(self, peer: tuple[str, int]) -> int | None:
        """The request id of the command holding the client end `peer` of a proxied connection.

        With one command running it is that one (no other process is left in the sandbox: a command's
        whole pid namespace ends with it). Otherwise its socket's inode is looked up in the warden's
        /proc/net/tcp, and the fds of each command and its descendants — off the event loop, since the
        kernel walks its whole TCP table for that file."""
        running = set(self._warden_pids.values())
        if len(running) <= 1:
            return next(iter(running), None)
        return await asyncio.get_running_loop().run_in_executor(None, self._scan_owner, peer)

    def _scan_owner(self, peer: tuple[str, int]) -> int | None:
        warden = self._warden_host_pid
        if warden is None or not self._warden_pids:
            return None
        holder = command_holding(warden, peer)
        return None if holder is None else self._warden_pids.get(holder)
