"""How a request body's validation error is worded in a 4xx `{"error": …}`: the message pydantic gives,
except where the JSON parser's own words mislead. A string escape naming a lone surrogate (`"\\ud800"`
alone) is valid JSON syntax but no Unicode text, and pydantic-core says "unexpected end of hex escape"
for it; bytes that are not UTF-8 it calls an "invalid unicode code point". Both are said for what they
are, at the position the parser gives; a field's string holding one (where the body was decoded by the
standard library, which lets a lone surrogate through) is named by its field."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_AT = re.compile(r" at line \d+ column \d+$")
_SURROGATE = ("unexpected end of hex escape", "lone leading surrogate in hex escape",
              "lone trailing surrogate in hex escape")
_NOT_UTF8 = ("invalid unicode code point",)


def error_message(error: Mapping[str, Any]) -> str:
    """One validation error's message (`error`: an entry of `ValidationError.errors()`), reworded where
    it is a JSON body that is not Unicode text: a lone surrogate escape, or bytes that are not UTF-8."""
    msg = str(error.get("msg", ""))
    if error.get("type") == "string_unicode":  # a field's string that the JSON decoder let through
        return ("not valid Unicode text: it holds a lone surrogate (\\ud800-\\udfff without its pair) or bytes "
                "that are not UTF-8")
    if error.get("type") != "json_invalid":
        return msg
    detail = str((error.get("ctx") or {}).get("error", msg.removeprefix("Invalid JSON: ")))
    where = _AT.search(detail)
    at = where.group(0) if where else ""
    said = detail[: where.start()] if where else detail
    if said in _SURROGATE:
        return (f"the body is not valid Unicode text: it holds a lone surrogate escape (\\ud800-\\udfff "
                f"without its pair){at}")
    if said in _NOT_UTF8:
        return f"the body is not valid UTF-8 text{at}"
    return msg
