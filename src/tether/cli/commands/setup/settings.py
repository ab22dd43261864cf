"""The server's settings and database as the set-up commands take them (`--db`, the settings from
options), and the hint a new server's first admin token is shown."""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Annotated

import typer

from tether.cli.common import console, fail

DbOpt = Annotated[str | None, typer.Option(
    "--db", metavar="PATH|URL", help="server database: a SQLite file (default: state dir/server.db) or a "
                                     "postgresql://USER@HOST:PORT/DB URL shared by several servers "
                                     "(default $TETHER_DB_URL; a password goes in ~/.pgpass or PGPASSWORD)")]

def _settings(**overrides: object):
    from tether.server.settings import ServerSettings
    from tether.server.store.engine import is_url

    clean = {k: v for k, v in overrides.items() if v is not None}
    if "db_path" not in clean and os.environ.get("TETHER_DB_URL") and "db_path" in overrides:
        clean["db_path"] = os.environ["TETHER_DB_URL"]
    if "db_path" in clean:
        if is_url(str(clean["db_path"])):
            clean["db_url"] = str(clean.pop("db_path"))
        else:
            clean["db_path"] = str(Path(str(clean["db_path"])).expanduser())
    from pydantic import ValidationError

    try:
        return ServerSettings(**clean)
    except ValidationError as exc:  # one line per problem, named by its option, not pydantic's report
        fail("; ".join(f"{'.'.join(map(str, e['loc'])) or 'server settings'}: "
                       f"{e['msg'].removeprefix('Value error, ')}" for e in exc.errors()))
    except ValueError as exc:
        fail(str(exc))


def _first_admin_hint(target: str | Path, db: str | None) -> None:
    """On a server with no person's admin token yet, say how to make the first one (pairing, policy, audit,
    webhooks and `mcp config` all need one)."""
    from tether.server.store import Store

    store = Store(target)
    try:
        made = any(t.active and t.kind == "api" and not t.agent and t.allows("admin") for t in store.tokens.all())
    finally:
        store.close()
    if not made:
        where = "" if not db else f" --db {shlex.quote(db)}" if "://" not in db else " --db <the same URL>"
        console(err=True).print(f"no admin token yet: on this machine, run `tether token create --admin{where}`; it is "
                                "saved to ~/.config/tether/token (mode 0600), where the CLI looks for it (the "
                                "dashboard takes it at login)", markup=False, soft_wrap=True)
