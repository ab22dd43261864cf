"""A small real GTK 3 program for the accessibility (AT-SPI) tests and bench: a text field, buttons, a check box.

    /usr/bin/python3 bench/kit/gtk_app.py EVENTS.jsonl [--title TITLE]

It runs under the system Python (Debian's python3-gi and gir1.2-gtk-3.0), not tether's venv. GTK 3 talks
to the accessibility bus itself (atk-bridge) when the session bus has org.a11y.Bus (at-spi2-core).
Every event (ready, clicks, the field's text on Submit, toggles) is appended to EVENTS.jsonl as one JSON
object per line and flushed at once, so a test waits on the file instead of sleeping. Fonts are large so
OCR reads the labels too (the bench compares the two ways of clicking on the same button).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import gi

gi.require_version("Gtk", "3.0")
from gi.repository import Gio, GLib, Gtk  # noqa: E402

REGISTRY = "org.a11y.atspi.Registry"
ROOT = "/org/a11y/atspi/accessible/root"

CSS = b"* { font-family: 'DejaVu Sans'; font-size: 24px; } entry { min-width: 420px; }"


class App:
    """The window and its event log (one object, so the callbacks share no globals)."""

    def __init__(self, log_path: str, title: str) -> None:
        self.log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (open for the program's life)
        style = Gtk.CssProvider()
        style.load_from_data(CSS)
        self.window = Gtk.Window(title=title)
        Gtk.StyleContext.add_provider_for_screen(self.window.get_screen(), style,
                                                 Gtk.STYLE_PROVIDER_PRIORITY_APPLICATION)
        self.window.set_default_size(900, 400)
        self.window.move(0, 0)
        self.window.connect("destroy", Gtk.main_quit)
        box = Gtk.Box(orientation=Gtk.Orientation.VERTICAL, spacing=20, margin=20)
        self.entry = Gtk.Entry()
        self.entry.get_accessible().set_name("Message")
        box.pack_start(self.entry, False, False, 0)
        row = Gtk.Box(orientation=Gtk.Orientation.HORIZONTAL, spacing=60)
        self.count = 0
        self.shown = 0
        for label, handler in (("Submit", self.on_submit), ("Cancel", self.on_cancel),
                               ("Show Later", self.on_show_later)):
            button = Gtk.Button(label=label)
            button.connect("clicked", handler)
            row.pack_start(button, False, False, 0)
        box.pack_start(row, False, False, 0)
        self.check = Gtk.CheckButton(label="Remember me")
        self.check.connect("toggled", lambda b: self.write("toggled", active=b.get_active()))
        box.pack_start(self.check, False, False, 0)
        self.status = Gtk.Label(label="")
        box.pack_start(self.status, False, False, 0)
        self.window.add(box)
        self.window.connect("map-event", self.on_mapped)
        self.window.show_all()

    def write(self, event: str, **data: Any) -> None:
        self.log.write(json.dumps({"event": event, "t": time.time(), **data}) + "\n")
        self.log.flush()

    def on_mapped(self, *_args: Any) -> bool:
        self.entry.grab_focus()
        when_registered(lambda: self.write("ready", pid=os.getpid(), title=self.window.get_title()))
        return False

    def on_submit(self, _button: Gtk.Button) -> None:
        self.count += 1
        self.write("submit", text=self.entry.get_text(), count=self.count)

    def on_cancel(self, _button: Gtk.Button) -> None:
        self.write("cancel")

    def on_show_later(self, _button: Gtk.Button) -> None:
        self.shown += 1
        number = self.shown

        def show() -> bool:
            self.status.set_text(f"Build {number} succeeded")
            self.write("shown", text=self.status.get_text())
            return False

        GLib.timeout_add(1000, show)
        self.write("show_later")


def when_registered(ready: Any) -> None:
    """Call `ready` once this process is listed by the accessibility registry: at once if it already is,
    else on the registry's ChildrenChanged signal (GTK registers asynchronously). Without an accessibility
    bus, at once: the program still serves the OCR side of the bench."""
    try:
        session = Gio.bus_get_sync(Gio.BusType.SESSION, None)
        reply = session.call_sync("org.a11y.Bus", "/org/a11y/bus", "org.a11y.Bus", "GetAddress", None,
                                  GLib.VariantType("(s)"), Gio.DBusCallFlags.NONE, 5000, None)
        bus = Gio.DBusConnection.new_for_address_sync(
            reply.unpack()[0], Gio.DBusConnectionFlags.AUTHENTICATION_CLIENT
            | Gio.DBusConnectionFlags.MESSAGE_BUS_CONNECTION, None, None)
    except GLib.Error:
        ready()
        return
    done = []

    def check(*_args: Any) -> None:
        if done:
            return
        kids = bus.call_sync(REGISTRY, ROOT, "org.a11y.atspi.Accessible", "GetChildren", None, None,
                             Gio.DBusCallFlags.NONE, 5000, None).unpack()[0]
        for name, _path in kids:
            pid = bus.call_sync("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                                "GetConnectionUnixProcessID", GLib.Variant("(s)", (name,)), None,
                                Gio.DBusCallFlags.NONE, 5000, None).unpack()[0]
            if pid == os.getpid():
                done.append(bus)  # keeps the connection (and its subscription) alive no longer than needed
                ready()
                return

    bus.signal_subscribe(REGISTRY, "org.a11y.atspi.Event.Object", "ChildrenChanged", ROOT, None,
                         Gio.DBusSignalFlags.NONE, check)
    check()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log")
    parser.add_argument("--title", default="Tether GTK App")
    args = parser.parse_args()
    App(args.log, args.title)
    Gtk.main()


if __name__ == "__main__":
    main()
