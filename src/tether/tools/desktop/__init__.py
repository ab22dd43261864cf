"""The desktop family (X11): `tool` (screenshot, the OCR'd UI tree, mouse and keyboard), `ui` (the
`ui.*` skills: findAndClick, typeText, waitFor), `desk` (`Desktop`, what one tool set owns; both build
on it), `keys` (key and button tokens), `screen` (capturing the screen), `ocr` (the text on it) and
`x11` (the display, its windows and xdotool).

Importing this package imports nothing else; import the module you need.
"""
