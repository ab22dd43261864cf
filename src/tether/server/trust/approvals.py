"""Who may approve: a person's token, never an agent's; and, with four-eyes on, never the one who asked.

Every surface that approves (REST, the CLI through it, the MCP gateway's tools and its elicitation) asks
these functions, so an agent is refused with the same words everywhere: what it may not do and how a
person does it instead (the dashboard, the CLI). See docs/security/approvals.md.
"""

from __future__ import annotations

from typing import Any, Protocol

from tether.errors import ServerError
from tether.server.store.tokens import TokenInfo


class ApprovalRefused(ServerError):
    """This token may not give this approval; `str()` says why and how a person gives it (a 403)."""

    status = 403


def server_url(settings: Any) -> str | None:
    """The server's own base URL from its settings (for messages given where no HTTP request is at hand)."""
    if settings is None or not hasattr(settings, "port"):
        return None
    host = str(getattr(settings, "host", "127.0.0.1"))
    if host in ("", "::") or host == ".".join("0" * 4):  # listening everywhere: this machine answers too
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"{'https' if getattr(settings, 'tls', False) else 'http'}://{host}:{settings.port}"


def dashboard_url(base_url: str | None, task_id: str | None = None) -> str:
    """The dashboard page where a person approves: the task's page when there is a task."""
    base = (base_url or "http://SERVER").rstrip("/")
    return f"{base}/#/tasks/{task_id}" if task_id else f"{base}/#/tasks"


def how_a_person_approves(base_url: str | None, *, task_id: str | None = None, device: str | None = None,
                          tool: str | None = None, question: str | None = None, undo: bool = False) -> str:
    """One sentence naming the ways a person gives this approval (or, `undo`, undoes the task), with a
    person's token."""
    if undo and task_id is not None:
        return (f"a person undoes it in the dashboard ({dashboard_url(base_url, task_id)}) or with "
                f"`tether undo {task_id}`, using a person's token (one made without --agent)")
    if task_id is not None and question is not None:
        cli = f"`tether answer {task_id} ANSWER`"
    elif task_id is not None:
        cli = f"`tether approve {task_id}` (or `tether deny {task_id}`)"
    elif device is not None and question is not None:
        cli = f"POST /api/v1/devices/{device}/questions/{question}"
    else:
        cli = f"`tether exec --device {device or 'DEVICE'} {tool or 'TOOL'} ... --approve`"
    return (f"a person approves in the dashboard ({dashboard_url(base_url, task_id)}) or with {cli}, "
            "using a person's token (one made without --agent)")


def check_approver(who: TokenInfo, what: str, how: str) -> None:
    """`ApprovalRefused` unless `who` may approve: a person's token holding `approve` (or `admin`).

    `what` is the approval in words ("approve task X's action"); `how` is `how_a_person_approves(...)`."""
    if who.agent:
        raise ApprovalRefused(f"token '{who.name}' is an agent's token, and an agent never approves (its own "
                              f"actions or anyone's), so it may not {what}: {how}")
    if not who.allows("approve"):
        raise ApprovalRefused(f"token '{who.name}' lacks the 'approve' scope needed to {what}; create one with "
                              f"'tether token create --api NAME --scope approve'; or {how}")


def check_four_eyes(enabled: bool, requested_by: str | None, approver: str, what: str) -> None:
    """With four-eyes on, `ApprovalRefused` when the approver is the requester (the same API token).

    Both are audit names (`api:NAME`, `mcp:CLIENT by api:NAME`, `task:ID for api:NAME`); they are
    compared by the API token they name."""
    if not enabled or requested_by is None:
        return
    if token_of(requested_by) == token_of(approver):
        raise ApprovalRefused(f"four-eyes is on: '{token_of(approver)}' asked for this, so another person must "
                              f"{what}")


class NamedToken(Protocol):
    """An API token as far as who-may-answer goes (`TokenInfo`, or a batch's `TokenRef`)."""

    @property
    def name(self) -> str: ...

    @property
    def agent(self) -> bool: ...


def check_answerer(asker: NamedToken | None, answerer: NamedToken, *, consent: bool, four_eyes: bool,
                   what: str, how: str) -> None:
    """`ApprovalRefused` unless `answerer` may answer a question an external MCP server asked during the
    command of `asker` (the batch's caller; None: a batch without a recorded caller, whose route decides).

    The question is the caller's: a person's token answers its own command's questions, and no other
    token does; an agent's command's questions (an agent never answers) go to a person instead. With
    `four_eyes` on and a question that asks for consent (`consent`, `aip.questions.asks_consent`), the
    caller's own token may not give it: another person does. An agent's token never answers. `what` is the
    answer in words ("answer question Q of device D"); `how` is `how_a_person_approves(...)`."""
    if answerer.agent:
        raise ApprovalRefused(f"token '{answerer.name}' is an agent's token, and an agent never answers a question "
                              f"meant for a person, so it may not {what}: {how}")
    if asker is None:
        return
    own = answerer.name == asker.name
    if own and four_eyes and consent:
        raise ApprovalRefused(f"four-eyes is on and this question asks for consent to a command of 'api:{asker.name}', "
                              f"so another person holding 'approve' for the device must {what}: {how}")
    if own or asker.agent or (four_eyes and consent):
        return
    raise ApprovalRefused(f"this question belongs to the command of token '{asker.name}', so only that token may "
                          f"{what} (with four-eyes on, another person answers one that asks for consent); token "
                          f"'{answerer.name}' may not: the person holding '{asker.name}' answers it ({how})")


def token_of(name: str) -> str:
    """The API token an audit name stands for (`api:alice` from `mcp:desk/1 by api:alice`), else the name."""
    for marker in (" by ", " for "):
        if marker in name:
            name = name.rsplit(marker, 1)[1]
    return name
