"""Pointer and keyboard input on a wlroots compositor, spoken over the Wayland wire by a minimal client.

The pointer is a `zwlr_virtual_pointer_v1` (absolute motion, buttons, wheel); the keyboard a
`zwp_virtual_keyboard_v1` fed an XKB keymap made for the keys it will press (the keymap travels as a
file descriptor, SCM_RIGHTS). Every call ends with a wl_display.sync round trip, so when it returns the
compositor has handled the events. A `WlInput` is one connection: `open()` it, use it, `close()` it.
"""

from __future__ import annotations

import os
import socket
import struct
import time

from tether.tools.desktop.wayland import PROBE_TIMEOUT_S

BTN = {"left": 0x110, "right": 0x111, "middle": 0x112}
MODIFIER_BITS = {"shift": 1, "ctrl": 4, "alt": 8, "super": 64}
KEYMAP_FORMAT_XKB_V1 = 1
# one keymap for the keyboard's life covers these (a keymap change right before a key can lose the key);
# other characters extend it
NAMED_KEYS = ("Return", "Tab", "Escape", "BackSpace", "Delete", "Insert", "Up", "Down", "Left", "Right", "Home",
              "End", "Page_Up", "Page_Down", "space", "Menu", "Print", "plus", *(f"F{i}" for i in range(1, 25)))


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<I", len(raw)) + raw + b"\0" * (-len(raw) % 4)


def _fixed(value: float) -> int:
    return round(value * 256)


def keymap_for(keysyms: list[str]) -> str:
    """An XKB keymap whose keycodes 9, 10, ... carry `keysyms` (one level each, no shift needed)."""
    codes = "\n".join(f"<K{i}> = {i + 9};" for i in range(len(keysyms)))
    symbols = "\n".join(f"key <K{i}> {{[ {sym} ]}};" for i, sym in enumerate(keysyms))
    return ("xkb_keymap {\nxkb_keycodes \"(unnamed)\" {\nminimum = 8;\nmaximum = 255;\n" + codes + "\n};\n"
            "xkb_types \"(unnamed)\" { include \"complete\" };\n"
            "xkb_compatibility \"(unnamed)\" { include \"complete\" };\n"
            "xkb_symbols \"(unnamed)\" {\n" + symbols + "\n};\n};\n")


def keysym_of(char: str) -> str:
    """The keysym name XKB takes for one character (Unicode keysyms: U+XXXX)."""
    return f"U{ord(char):04X}"


BASE_KEYSYMS = (*(keysym_of(chr(c)) for c in range(33, 127)), *(chr(c) for c in range(97, 123)), *NAMED_KEYS)


class WlInput:
    """One connection to the compositor with a virtual pointer and keyboard on its first seat."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.sock: socket.socket | None = None
        self._next = 2
        self.globals: dict[str, tuple[int, int]] = {}

    def _new_id(self) -> int:
        self._next += 1
        return self._next

    def _send(self, obj: int, opcode: int, args: bytes = b"", fds: tuple[int, ...] = ()) -> None:
        assert self.sock is not None
        data = struct.pack("<II", obj, (8 + len(args)) << 16 | opcode) + args
        if fds:
            socket.send_fds(self.sock, [data], list(fds))
        else:
            self.sock.sendall(data)

    def roundtrip(self) -> None:
        """wl_display.sync and wait for its done, taking in registry globals on the way."""
        assert self.sock is not None
        callback = self._new_id()
        self._send(1, 0, struct.pack("<I", callback))
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        buf = b""
        while True:
            while len(buf) < 8 or len(buf) < (struct.unpack_from("<I", buf, 4)[0] >> 16):
                self.sock.settimeout(max(0.01, deadline - time.monotonic()))
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise OSError("the compositor closed the connection")
                buf += chunk
            obj, word = struct.unpack_from("<II", buf)
            size, opcode = word >> 16, word & 0xFFFF
            body, buf = buf[8:size], buf[size:]
            if obj == 2 and opcode == 0:
                (name,) = struct.unpack_from("<I", body)
                (length,) = struct.unpack_from("<I", body, 4)
                interface = body[8:8 + length - 1].decode()
                (version,) = struct.unpack_from("<I", body, 8 + (length + 3) // 4 * 4)
                self.globals[interface] = (name, version)
            elif obj == callback and opcode == 0:
                return
            elif obj == 1 and opcode == 0:
                message = body[12:].split(b"\0", 1)[0].decode(errors="replace")
                raise OSError(f"the compositor reported a protocol error: {message!r}")

    def _bind(self, interface: str, version: int) -> int:
        if interface not in self.globals:
            raise OSError(f"the compositor does not offer {interface}")
        name, offered = self.globals[interface]
        new = self._new_id()
        self._send(2, 0, struct.pack("<I", name) + _string(interface) + struct.pack("<II", min(version, offered), new))
        return new

    def open(self) -> WlInput:
        """Connect, bind the seat and both managers, and create the pointer and keyboard."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(PROBE_TIMEOUT_S)
        self.sock.connect(self.path)
        self._send(1, 1, struct.pack("<I", 2))  # wl_display.get_registry -> 2
        self.roundtrip()
        seat = self._bind("wl_seat", 1)
        pointers = self._bind("zwlr_virtual_pointer_manager_v1", 1)
        keyboards = self._bind("zwp_virtual_keyboard_manager_v1", 1)
        self.pointer, self.keyboard = self._new_id(), self._new_id()
        self._send(pointers, 0, struct.pack("<II", seat, self.pointer))
        self._send(keyboards, 0, struct.pack("<II", seat, self.keyboard))
        self._syms: list[str] = []
        self._keymap(list(BASE_KEYSYMS))
        self.roundtrip()
        return self

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    @staticmethod
    def _ms() -> int:
        return int(time.monotonic() * 1000) & 0xFFFFFFFF

    def click(self, x: int, y: int, width: int, height: int, button: str, count: int = 1) -> None:
        """Move to (x, y) on a width x height layout and click `button` `count` times."""
        self._send(self.pointer, 1, struct.pack("<IIIII", self._ms(), x, y, width, height))
        self._send(self.pointer, 4)
        for _ in range(count):
            for state in (1, 0):
                self._send(self.pointer, 2, struct.pack("<III", self._ms(), BTN[button], state))
                self._send(self.pointer, 4)
        self.roundtrip()

    def scroll(self, x: int | None, y: int | None, width: int, height: int, direction: str, notches: int) -> None:
        if x is not None and y is not None:
            self._send(self.pointer, 1, struct.pack("<IIIII", self._ms(), x, y, width, height))
            self._send(self.pointer, 4)
        axis = 0 if direction in ("up", "down") else 1
        sign = -1 if direction in ("up", "left") else 1
        for _ in range(notches):
            self._send(self.pointer, 5, struct.pack("<I", 0))  # axis source: wheel
            self._send(self.pointer, 7, struct.pack("<IIii", self._ms(), axis, _fixed(15 * sign), sign))
            self._send(self.pointer, 4)
        self.roundtrip()

    def _keymap(self, keysyms: list[str]) -> None:
        self._syms = list(dict.fromkeys(keysyms))
        text = keymap_for(self._syms).encode() + b"\0"
        fd = os.memfd_create("tether-keymap", os.MFD_CLOEXEC)
        try:
            os.write(fd, text)
            self._send(self.keyboard, 0, struct.pack("<II", KEYMAP_FORMAT_XKB_V1, len(text)), (fd,))
        finally:
            os.close(fd)

    def keys(self, strokes: list[tuple[list[str], str]], delay_ms: int = 0) -> None:
        """Press each (modifiers, keysym) in turn: modifiers held by state, the key pressed and released."""
        missing = [sym for _mods, sym in strokes if sym not in self._syms]
        if missing:  # XKB keycodes end at 255: past that, the base and what this call needs
            extended = [*self._syms, *missing]
            self._keymap(extended if len(extended) <= 240 else [*BASE_KEYSYMS, *missing])
            self.roundtrip()
        for mods, sym in strokes:
            mask = 0
            for m in mods:
                mask |= MODIFIER_BITS[m]
            if mask:
                self._send(self.keyboard, 2, struct.pack("<IIII", mask, 0, 0, 0))
            code = self._syms.index(sym) + 1  # evdev code: XKB keycode - 8
            for state in (1, 0):
                self._send(self.keyboard, 1, struct.pack("<III", self._ms(), code, state))
            if mask:
                self._send(self.keyboard, 2, struct.pack("<IIII", 0, 0, 0, 0))
            if delay_ms:
                self.roundtrip()
                time.sleep(delay_ms / 1000)  # the caller's pacing between keys
        self.roundtrip()
