"""A small real Tk program for the desktop tests: a text field and buttons labelled by text.

    python bench/kit/gui_app.py EVENTS.jsonl [--title TITLE] [--geometry WxH+X+Y]

Every event (ready, button clicks, the field's text on Submit / Return, focus changes) is appended
to EVENTS.jsonl as one JSON object per line and flushed at once, so a test can wait on the file
instead of sleeping. Fonts are large and plain so OCR reads the labels reliably.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tkinter as tk
from typing import Any

FONT = ("DejaVu Sans", 24)


class App:
    """The window and its event log; kept in one object so the callbacks share no globals."""

    def __init__(self, log_path: str, title: str, geometry: str) -> None:
        self.log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 (open for the program's life)
        self.root = tk.Tk(className="TetherTestApp")
        self.root.title(title)
        self.root.geometry(geometry)
        self.root.configure(background="white")
        opts: dict[str, Any] = {"font": FONT, "background": "white", "foreground": "black"}
        self.entry = tk.Entry(self.root, width=22, name="entry", font=FONT, background="white",
                              foreground="black", relief="solid", borderwidth=2)
        self.entry.grid(row=0, column=0, columnspan=3, padx=20, pady=20, sticky="w")
        buttons = tk.Frame(self.root, background="white")
        buttons.grid(row=1, column=0, columnspan=3, padx=20, pady=10, sticky="w")
        self.submit = tk.Button(buttons, text="Submit", name="submit", command=lambda: self.on_submit("button"),
                                **opts)
        self.cancel = tk.Button(buttons, text="Cancel", name="cancel", command=self.on_cancel, **opts)
        self.later = tk.Button(buttons, text="Show Later", name="show_later", command=self.on_show_later, **opts)
        for i, button in enumerate((self.submit, self.cancel, self.later)):
            button.grid(row=0, column=i, padx=(0, 60))
        self.status = tk.Label(self.root, text="", name="status", **opts)
        self.status.grid(row=2, column=0, columnspan=3, padx=20, pady=30, sticky="w")
        self.root.bind("<Return>", lambda _e: self.on_submit("key"))
        for widget in (self.entry, self.submit, self.cancel, self.later):
            widget.bind("<FocusIn>", lambda e: self.write("focus", widget=e.widget.winfo_name()))
        self.root.update()  # map and draw now, so 'ready' means the window is on screen
        self.ready()

    def write(self, event: str, **data: Any) -> None:
        self.log.write(json.dumps({"event": event, "t": time.time(), **data}) + "\n")
        self.log.flush()

    def ready(self) -> None:
        self.root.focus_force()
        self.entry.focus_set()
        # where each button is on the screen (centre), for tests that click by coordinates
        centres = {b.winfo_name(): [b.winfo_rootx() + b.winfo_width() // 2, b.winfo_rooty() + b.winfo_height() // 2]
                   for b in (self.submit, self.cancel, self.later)}
        self.write("ready", pid=os.getpid(), window=self.root.wm_frame(), title=self.root.title(), buttons=centres)

    def on_submit(self, via: str) -> None:
        self.write("submit", text=self.entry.get(), via=via)

    def on_cancel(self) -> None:
        self.write("cancel")

    def on_show_later(self) -> None:
        self.write("show_later")
        self.root.after(1000, self.show_result)

    def show_result(self) -> None:
        self.status.configure(text="Build succeeded")
        self.root.update_idletasks()
        self.write("shown", text="Build succeeded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("log")
    parser.add_argument("--title", default="Tether Test App")
    parser.add_argument("--geometry", default="900x420+40+40")
    args = parser.parse_args()
    App(args.log, args.title, args.geometry).root.mainloop()


if __name__ == "__main__":
    main()
