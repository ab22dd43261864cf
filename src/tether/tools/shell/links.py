"""Why a sandboxed command's changes that `layer.conflicts` flagged are refused, in words a person
can act on: a hard link the command made, or a real conflict."""

from __future__ import annotations

from typing import Any

from tether.sandbox.layers.fs import shown
from tether.sandbox.layers.layer import ApplyConflict, Change
from tether.sandbox.layers.links import hard_links
from tether.tools.context import ToolContext
from tether.tools.policy.path_rules import protected_rule


def refusal(ctx: ToolContext, changes: list[Change], clashes: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Why changes that `conflicts` flagged are refused: a hard link the command made to an existing
    file (`hard_links`: named with its other name and, where that is protected, its rule), else a
    real conflict (`ApplyConflict`); and the links as a reply lists them."""
    links = hard_links(changes, clashes)
    if not links:
        return str(ApplyConflict(clashes)), []
    listed: list[dict[str, Any]] = []
    said: list[str] = []
    for path, names in list(links.items())[:10]:
        rules = [r for n in names if (r := protected_rule(ctx.policy, n))]
        entry: dict[str, Any] = {"path": shown(path), "links_to": [shown(n) for n in names]}
        if rules:
            entry["rule"] = rules[0]
        listed.append(entry)
        to = " and ".join(shown(n) for n in names[:3]) or "a file outside the command's view"
        said.append(f"{shown(path)} is a hard link the command made to {to}"
                    + (f", a protected path ({rules[0]})" if rules else ""))
    text = "; ".join(said) + ("; " if said else "") + ("a sandboxed command's new name (hard link) for a file it "
                                                        "did not create is never applied")
    rest = [p for p in clashes if p not in links]
    if rest:
        text += f"; and {ApplyConflict(rest)}"
    return text, listed
