"""The bodies webhooks receive: Slack-compatible (`text` and `blocks` with fields) or generic JSON.

Both carry one sentence (`text`) and the event's fields in order (device, task, tool, who asked…); the
generic body adds the event's name, its id, time and data. Untrusted strings (a device's name, a task's
request, an MCP server's question) are cut to a bound and, in Slack's markup, escaped.
"""

from __future__ import annotations

import json
import time
from typing import Any

EVENTS = ("approval.needed", "task.finished", "task.failed", "device.offline")
TEST_EVENT = "ping"
FORMATS = ("slack", "generic")
MAX_FIELD = 300  # characters of one field's value
MAX_TEXT = 1000  # characters of the sentence


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _slack_escape(text: str) -> str:
    """Slack's markup escapes: &, < and > (a `<url|label>` in a device's name must not become a link)."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render(fmt: str, event: str, delivery_id: str, text: str, fields: dict[str, Any],
           data: dict[str, Any], link: str | None = None) -> str:
    """The JSON body of one delivery in `fmt` ("slack" or "generic")."""
    text = _cut(text, MAX_TEXT)
    shown = {k: _cut(str(v), MAX_FIELD) for k, v in fields.items() if v not in (None, "")}
    if fmt == "slack":
        blocks: list[dict[str, Any]] = [{"type": "section", "text": {"type": "mrkdwn", "text": _slack_escape(text)}}]
        if shown:
            blocks.append({"type": "section", "fields": [
                {"type": "mrkdwn", "text": f"*{_slack_escape(k)}*\n{_slack_escape(v)}"} for k, v in
                list(shown.items())[:10]]})  # Slack takes at most 10 fields in a section
        if link:
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": f"<{link}|Open in tether>"}]})
        return json.dumps({"text": _slack_escape(text), "blocks": blocks})
    return json.dumps({"event": event, "id": delivery_id, "at": time.time(), "text": text, "fields": shown,
                       "link": link, "data": data})
