"""The root command's sub-commands, each loaded when it runs: `tether --help` lists them all from the
table below without importing one command module, so it costs typer and rich, not the server, the
agent or pydantic (modules whose commands do not run).

A command module (in a family of `tether.cli.commands`: `tasks`, `fleet`, `setup`) attaches its commands
to the typer apps in `tether.cli.common` when it is imported; `LazyGroup.get_command` imports the modules
named for a command the first time the command is resolved to run or to show its own help, then builds it with
typer. This module imports no other module of tether.cli: the group that uses it says which typer
app it was built from (`LazyGroup.root_app`).
"""

from __future__ import annotations

import fnmatch
import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, NamedTuple

from typer.core import TyperCommand, TyperGroup

if TYPE_CHECKING:
    import typer

PACKAGE = "tether.cli.commands"  # where the modules named in `COMMANDS` live


class Lazy(NamedTuple):
    """Where a top-level command comes from, and its one line in `tether --help`."""

    modules: tuple[str, ...]  # modules of `PACKAGE` (`family.module`) that attach the command or its sub-commands
    # (or a pattern of modules in one family: `setup.mcp_*`)
    help: str


# Every top-level command. A new command module adds its command here (tests/cli/test_startup.py checks the
# table against what the modules attach: names, the modules a command needs, and its help line).
COMMANDS: dict[str, Lazy] = {
    "run": Lazy(("tasks.run",),
                "Plan and run a task with live progress; questions are asked in the terminal."),
    "exec": Lazy(("fleet.tools",),
                 "Run one tool and print its structured result; exit code 1 when the result is a failure."),
    "demo": Lazy(("tasks.demo",),
                 "Run a short demo that needs no LLM key: a server, a device, and commands through them."),
    "tasks": Lazy(("tasks.run",),
                  "List tasks newest first with their state: the server's with --server (or TETHER_SERVER), "
                  "else this machine's."),
    "log": Lazy(("tasks.run",),
                "Show a task's plan, every step with its command and result, decisions, questions and answer: "
                "the server's task with --server (or TETHER_SERVER), else this machine's."),
    "answer": Lazy(("tasks.task",),
                   "Answer the open question of a task on the server; the task resumes where it stopped."),
    "approve": Lazy(("tasks.task",),
                    "Approve the action a task on the server waits on (with --deny: deny it, which cancels "
                    "the task)."),
    "deny": Lazy(("tasks.task",), "Deny the action a task on the server waits on; the task is cancelled."),
    "edit": Lazy(("tasks.task",),
                 "Edit a running graph task on the server from a YAML or JSON file: add steps, remove steps "
                 "not started, add needs."),
    "cancel": Lazy(("tasks.task",),
                   "Cancel a task: on the server with --server (or TETHER_SERVER; the command it is running is "
                   "stopped on its device), else this machine's (an interrupted one, or one no tether process "
                   "runs any more)."),
    "approvals": Lazy(("tasks.approvals",),
                      "List what waits for your answer (approvals, plans to confirm, questions), and answer it."),
    "webhooks": Lazy(("tasks.approvals",),
                     "Webhooks told of approvals needed, tasks finished or failed, devices offline."),
    "undo": Lazy(("tasks.journal",),
                 "Put back the files that a session's commands changed (a local task's id is its session)."),
    "sessions": Lazy(("tasks.journal",),
                     "List the sessions that have journaled file changes (what `undo` can put back)."),
    "devices": Lazy(("setup.devices", "fleet.pairing", "fleet.fleet"),
                    "Show the server's devices, and let pairing devices in."),
    "policy": Lazy(("fleet.policy",), "Show or change a device's policy through the server."),
    "audit": Lazy(("fleet.audit",),
                  "Show the server's audit log, newest first: every command sent to a device, who asked, "
                  "its outcome."),
    "batch": Lazy(("fleet.audit",),
                  "Show a batch's record: each command's outcome, also one that came back after its caller "
                  "stopped waiting."),
    "cp": Lazy(("fleet.transfer",),
               "Send a file or directory from one device to another through the server: streamed in chunks, its "
               "sha256 checked on the receiver before it appears, resumed if a device reconnects, written under "
               "the receiver's policy (approvals, undo journal)."),
    "tools": Lazy(("fleet.tools",), "List tools, or serve a built-in tool set over MCP."),
    "server": Lazy(("setup.server", "setup.systemd"), "Start the agent server, or install it as a service."),
    "device": Lazy(("setup.device", "setup.systemd"),
                   "Connect this machine to a server as a device, or install it as a service."),
    "token": Lazy(("setup.token",), "Create, list and revoke device and API tokens."),
    "mcp": Lazy(("setup.mcp_*",), "MCP: plug a server's fleet into an MCP client, or serve this machine's tools."),
}

# Top-level commands by topic, in the order `tether --help` lists them: what a newcomer runs first, first.
COMMAND_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Run things", ("run", "exec", "demo")),
    ("Tasks", ("tasks", "log", "approvals", "answer", "approve", "deny", "edit", "cancel", "undo",
               "sessions")),
    ("Fleet", ("devices", "policy", "audit", "batch", "cp", "tools")),
    ("Set-up", ("server", "device", "token", "webhooks", "mcp")),
)

_LISTING = "tether.cli.lazy.listing"  # ctx.meta key: set while the root's help lists its commands


def all_modules() -> tuple[str, ...]:
    """Every module named in the table, once each, in table order (patterns as they are written)."""
    return tuple(dict.fromkeys(m for lazy in COMMANDS.values() for m in lazy.modules))


def expand(names: tuple[str, ...]) -> list[str]:
    """The modules of `PACKAGE` that `names` stand for, each as `family.module` (a sub-package of `PACKAGE` and a
    module of it): a name as it is, a pattern (`setup.mcp_*`) every module of its family it matches, so a new
    `tether mcp` sub-command module is found without an edit here."""
    out: list[str] = []
    for name in names:
        if "*" not in name:
            out.append(name)
            continue
        family, _, pattern = name.rpartition(".")
        path = importlib.import_module(f"{PACKAGE}.{family}" if family else PACKAGE).__path__
        found = sorted(f"{family}.{m.name}" if family else m.name
                       for m in pkgutil.iter_modules(path) if fnmatch.fnmatchcase(m.name, pattern))
        out.extend(found)
    return out


class LazyGroup(TyperGroup):
    """A group whose commands named in `COMMANDS` are imported on first use and shown in its help
    from the table (a placeholder with the declared help line, never the module). A subclass names the
    typer app the group is built from (`root_app`): the one the command modules attach to."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self._loaded: set[str] = set()  # names whose modules this group has imported and built

    def list_commands(self, ctx: Any) -> list[str]:
        return list(dict.fromkeys([*COMMANDS, *self.commands]))

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        lazy = COMMANDS.get(cmd_name)
        if lazy is None or cmd_name in self._loaded:
            return self.commands.get(cmd_name)
        if ctx.meta.get(_LISTING):
            return self._placeholder(cmd_name, lazy)
        return self._load(cmd_name, lazy)

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """click's, but a mistyped name fails (a usage error, exit 2) with the nearest names of the whole
        table, including commands whose modules are not imported yet: `No such command 'devcies'. Did
        you mean 'devices'?`."""
        known = self.list_commands(ctx)
        if args and not args[0].startswith("-") and args[0] not in known and not ctx.resilient_parsing:
            import difflib

            near = difflib.get_close_matches(args[0], known, n=3)
            hint = f" Did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            ctx.fail(f"No such command {args[0]!r}.{hint}")
        return super().resolve_command(ctx, args)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        ctx.meta[_LISTING] = True
        try:
            super().format_help(ctx, formatter)
        finally:
            ctx.meta.pop(_LISTING, None)

    def _placeholder(self, name: str, lazy: Lazy) -> Any:
        command = TyperCommand(name=name, help=lazy.help, short_help=lazy.help)
        command.rich_help_panel = self._panel(name)
        return command

    def root_app(self) -> typer.Typer:
        """The typer app this group was built from; a loaded command is built anew from it (its commands
        labelled and panelled as the root's). Raises NotImplementedError here: a subclass says."""
        raise NotImplementedError

    def _panel(self, name: str) -> str | None:
        return next((panel for panel, names in COMMAND_PANELS if name in names), None)

    def _load(self, name: str, lazy: Lazy) -> Any:
        import typer

        for module in expand(lazy.modules):
            importlib.import_module(f"{PACKAGE}.{module}")
        built = typer.main.get_command(self.root_app())  # a fresh root of what is attached now: labelled, panelled
        command = getattr(built, "commands", {}).get(name)
        if command is not None:
            self.commands[name] = command
            self._loaded.add(name)
        return command
