"""Where a person's API token is kept between commands, and reading it back: the CLI, `Client` and
`AsyncClient` all find a token the same way (`find_token`). No I/O at import."""

from __future__ import annotations

import os


def token_file_path() -> str:
    """Where the CLI keeps a person's API token (`tether token create --admin` writes it, mode 0600):
    $TETHER_TOKEN_FILE, else $XDG_CONFIG_HOME/tether/token (~/.config/tether/token)."""
    if os.environ.get("TETHER_TOKEN_FILE"):
        return os.path.expanduser(os.environ["TETHER_TOKEN_FILE"])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "tether", "token")


def saved_token() -> str | None:
    """The token in `token_file_path()`, or None when there is no such file (or it cannot be read)."""
    try:
        with open(token_file_path(), encoding="utf-8") as file:
            return file.read().strip() or None
    except OSError:
        return None


def find_token(token: str | None) -> str | None:
    """The token to send: `token` when given, else $TETHER_TOKEN, else the saved one (`saved_token`), else
    None (requests then go without one, and the server answers 401 where it needs one)."""
    return token or os.environ.get("TETHER_TOKEN") or saved_token()
