"""One reading of a person's answer to a task's question, for a local task and a server's alike.

A terminal and `--answer` are typed by a person: an empty line is no answer (asked again), an option
number that does not exist is a mistake (not words for the LLM to re-plan with), and the yes/no a
person types to an approval means approve/deny wherever the task runs.
"""

from __future__ import annotations

from tether.errors import AgentError

APPROVE_WORDS = frozenset({"approve", "approved", "yes", "y"})
DENY_WORDS = frozenset({"deny", "denied", "no", "n"})
# the question kinds only a person answers yes to: an action to approve, a plan to confirm (agent/run/confirm.py)
APPROVAL_KINDS = ("approval", "confirmation")


def says_no(answer: str, options: list[str]) -> bool:
    """Whether this answer to an approval or a confirmation refuses it (deny, no, cancel, or the number of
    such an option): anyone who may steer the task may say no; only a person may say yes."""
    text = answer.strip().lower()
    if text.isdigit() and 1 <= int(text) <= len(options):
        text = options[int(text) - 1].lower()
    return text in DENY_WORDS or text == "cancel"


class AnswerError(AgentError, ValueError):
    """An answer that cannot be taken as given: say why and ask again."""


class Unanswered(AgentError):
    """Nobody can answer here (no terminal and no --answer left): the question is left unanswered."""


def parse_answer(reply: str, options: list[str], kind: str = "question") -> str:
    """The answer to pass on: an approval's yes/no as its approve/deny option, an option's number as
    given (the task matches it), free words as they are. `AnswerError` for an empty answer or an
    option number out of range."""
    from tether.agent.run.decisions import OPTION_APPROVE, OPTION_DENY  # lazily: they bring planning's models

    text = reply.strip()
    if not text:
        raise AnswerError("the answer is empty" + (f"; the options are: {_listed(options)}" if options else ""))
    if text.isdigit() and options and not 1 <= int(text) <= len(options):
        raise AnswerError(f"there is no option {text}; choose 1 to {len(options)} ({_listed(options)})")
    if kind == "approval" or OPTION_APPROVE in options:
        if text.lower() in APPROVE_WORDS and OPTION_APPROVE in options:
            return OPTION_APPROVE
        if text.lower() in DENY_WORDS and OPTION_DENY in options:
            return OPTION_DENY
    return text


def _listed(options: list[str]) -> str:
    return ", ".join(f"{i} {option}" for i, option in enumerate(options, 1))
