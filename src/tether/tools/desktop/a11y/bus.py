"""Finding the accessibility bus and calling AT-SPI objects on it (with `jeepney`, pure Python).

The accessibility bus is a D-Bus bus of its own, started by at-spi-bus-launcher. Its address comes from,
in order: $AT_SPI_BUS_ADDRESS; `org.a11y.Bus.GetAddress` on the session bus (which starts the launcher
when it is not running); the `AT_SPI_BUS` property of the X root window (what the launcher publishes
there). A `Session` is one connection for one tool call: opening it costs under a millisecond, and a
connection that lives no longer than its call cannot outlive the event loop it was made on.

Every call has a deadline (`CALL_TIMEOUT_S`): an application that hangs costs one timeout, never a
stuck tool. D-Bus errors become `A11yError`s naming the object and method.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tether.tools.errors import ToolError

CALL_TIMEOUT_S = 3.0
ADDRESS_TIMEOUT_S = 5.0
PATH_PREFIX = "/org/a11y/atspi/accessible/"
ROOT_PATH = PATH_PREFIX + "root"
REGISTRY = "org.a11y.atspi.Registry"
ACCESSIBLE = "org.a11y.atspi.Accessible"
INSTALL_HINT = ("the accessibility tree needs the jeepney package (pip install 'tether[desktop]') and an "
                "accessibility bus (apt-get install at-spi2-core, and a D-Bus session bus)")
_ID = re.compile(r"a(\d+\.\d+)-([A-Za-z0-9_~]+)")


class A11yError(ToolError):
    """The accessibility bus cannot be reached, or an object on it refused or failed a call."""


@dataclass(frozen=True, slots=True)
class Ref:
    """One accessible object: the application's unique bus name and the object's path."""

    bus: str
    path: str

    @property
    def id(self) -> str:
        """A short id that stays the same for as long as the object lives (`a1.12-7`)."""
        tail = self.path[len(PATH_PREFIX):] if self.path.startswith(PATH_PREFIX) else \
            "~" + self.path.strip("/").replace("/", "~")
        return f"a{self.bus.lstrip(':')}-{tail}"

    @classmethod
    def from_id(cls, element_id: str) -> Ref | None:
        """The object an id names, or None when `element_id` is not an accessibility id."""
        m = _ID.fullmatch(element_id)
        if m is None:
            return None
        tail = m.group(2)
        path = "/" + tail[1:].replace("~", "/") if tail.startswith("~") else PATH_PREFIX + tail
        return cls(":" + m.group(1), path)

    @property
    def is_null(self) -> bool:
        return self.path in ("/org/a11y/atspi/null", "/")


def is_a11y_id(element_id: str) -> bool:
    return _ID.fullmatch(element_id) is not None


class Session:
    """One open connection to the accessibility bus (see the module docstring)."""

    def __init__(self, router: Any) -> None:
        self._router = router

    async def call(self, ref: Ref, interface: str, method: str, signature: str | None = None,
                   body: tuple[Any, ...] = (), timeout: float = CALL_TIMEOUT_S) -> tuple[Any, ...]:
        """Call `interface.method` on `ref` and return the reply's body; an A11yError on a D-Bus error
        or when no reply comes within `timeout` seconds."""
        from jeepney import DBusAddress, new_method_call
        from jeepney.wrappers import DBusErrorResponse, unwrap_msg

        msg = new_method_call(DBusAddress(ref.path, ref.bus, interface), method, signature, body)
        try:
            async with asyncio.timeout(timeout):
                reply = await self._router.send_and_get_reply(msg)
            return tuple(unwrap_msg(reply))
        except TimeoutError:
            raise A11yError(f"{ref.id} did not answer {method} within {timeout:g}s (is the application hung?)") \
                from None
        except DBusErrorResponse as exc:
            detail = exc.data[0] if exc.data else ""
            gone = exc.name in ("org.freedesktop.DBus.Error.ServiceUnknown", "org.freedesktop.DBus.Error.UnknownObject",
                                "org.freedesktop.DBus.Error.UnknownMethod", "org.freedesktop.DBus.Error.NoReply")
            why = " (the element or its application no longer exists, or it does not support this)" if gone else ""
            raise A11yError(f"{interface.rsplit('.', 1)[-1]}.{method} on {ref.id} failed: {exc.name} "
                            f"{detail}{why}".strip(), {"dbus_error": exc.name}) from None

    async def prop(self, ref: Ref, interface: str, name: str) -> Any:
        """One D-Bus property of `ref` (its value, the variant unwrapped)."""
        (variant,) = await self.call(ref, "org.freedesktop.DBus.Properties", "Get", "ss", (interface, name))
        return variant[1]

    async def pid_of(self, bus: str) -> int | None:
        """The process id behind a bus name (asked of the bus daemon), or None."""
        try:
            (pid,) = await self.call(Ref("org.freedesktop.DBus", "/org/freedesktop/DBus"), "org.freedesktop.DBus",
                                     "GetConnectionUnixProcessID", "s", (bus,))
        except A11yError:
            return None
        return int(pid)


class A11yBus:
    """Where the accessibility bus is; `session()` opens a connection to it for one call.

    `session_bus` is the session bus address to ask (default $DBUS_SESSION_BUS_ADDRESS) and `display`
    the X display whose root window may name the bus. The found address is kept, and looked up again
    when a connection to it fails (the launcher was restarted).
    """

    def __init__(self, session_bus: str | None = None, display: str | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.session_bus = session_bus if session_bus is not None else os.environ.get("DBUS_SESSION_BUS_ADDRESS")
        self.display = display
        self.env = env
        self._address: str | None = None

    async def address(self) -> str:
        """The accessibility bus address; an A11yError saying what was tried when there is none."""
        if self._address is None:
            self._address = await self._find_address()
        return self._address

    async def _find_address(self) -> str:
        tried = []
        explicit = os.environ.get("AT_SPI_BUS_ADDRESS")
        if explicit:
            return explicit
        tried.append("$AT_SPI_BUS_ADDRESS is not set")
        try:
            from jeepney import DBusAddress, new_method_call
            from jeepney.io.asyncio import open_dbus_router
            from jeepney.wrappers import unwrap_msg
        except ImportError:
            raise A11yError(INSTALL_HINT) from None
        if self.session_bus:
            try:
                async with asyncio.timeout(ADDRESS_TIMEOUT_S), open_dbus_router(self.session_bus) as router:
                    reply = await router.send_and_get_reply(new_method_call(
                        DBusAddress("/org/a11y/bus", "org.a11y.Bus", "org.a11y.Bus"), "GetAddress"))
                    (address,) = unwrap_msg(reply)
                    if address:
                        return str(address)
                tried.append("the session bus's org.a11y.Bus gave no address")
            except Exception as exc:  # any failure here means: try the next source
                tried.append(f"the session bus has no org.a11y.Bus ({type(exc).__name__}: {exc})")
        else:
            tried.append("no session bus ($DBUS_SESSION_BUS_ADDRESS is not set)")
        if self.display:
            address = await self._root_window_address()
            if address:
                return address
            tried.append(f"the X root window of {self.display} has no AT_SPI_BUS property")
        raise A11yError(f"no accessibility bus: {'; '.join(tried)}. {INSTALL_HINT}")

    async def _root_window_address(self) -> str | None:
        with contextlib.suppress(OSError, TimeoutError):
            proc = await asyncio.create_subprocess_exec(
                "xprop", "-root", "-notype", "AT_SPI_BUS", env=self.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
            try:
                async with asyncio.timeout(ADDRESS_TIMEOUT_S):
                    out, _ = await proc.communicate()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
            m = re.search(r'AT_SPI_BUS\s*=\s*"([^"]+)"', out.decode(errors="replace"))
            return m.group(1) if m else None
        return None

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Session]:
        """A connection to the accessibility bus for the length of the `async with`."""
        try:
            from jeepney.io.asyncio import open_dbus_router
        except ImportError:
            raise A11yError(INSTALL_HINT) from None
        address = await self.address()
        try:
            async with asyncio.timeout(ADDRESS_TIMEOUT_S):
                router_cm = open_dbus_router(address)
                router = await router_cm.__aenter__()
        except (OSError, TimeoutError, ValueError) as exc:
            self._address = None  # the launcher may have moved it: look again next time
            raise A11yError(f"cannot connect to the accessibility bus at {address}: {exc}") from None
        try:
            yield Session(router)
        finally:
            await router_cm.__aexit__(None, None, None)
