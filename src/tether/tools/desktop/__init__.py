"""The desktop family (X11, and sway on Wayland): `tool` (screenshot, the UI tree, mouse and keyboard),
`ui` (the `ui.*` skills: findAndClick, typeText, waitFor), `desk` (`Desktop`, what one tool set owns;
both build on it), `keys` (key and button tokens), `screen` (capturing the screen), `ocr` (the text on
it), `frames` (screenshots tied to actions), `a11y` (the AT-SPI accessibility tree), `x11` (the display,
its windows and xdotool), `sway` (the same on sway), `wlinput` (virtual pointer and keyboard over the
Wayland wire) and `wayland` (what a Wayland compositor offers).

Importing this package imports nothing else; import the module you need.
"""
