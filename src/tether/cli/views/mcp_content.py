"""Human output of an external MCP tool's result (`tether exec` without --json).

The result's shape is `{text, content, structured}` (`tether.tools.toolsets.mcp_export.content_payload`);
`mcp.read_resource` answers `{server, uri, text, contents}`. Text is printed as text (its newlines
kept, never read as markup); images, audio and blobs are binary, so they are written to files in
`--save-dir` (a new temporary directory by default) and their paths printed instead.
"""

from __future__ import annotations

import base64
import binascii
import json
import mimetypes
import re
import tempfile
from pathlib import Path
from typing import Any

from tether.cli.views.safe_text import console

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def is_mcp_shape(payload: Any) -> bool:
    return isinstance(payload, dict) and isinstance(payload.get("text"), str) and (
        isinstance(payload.get("content"), list) or isinstance(payload.get("contents"), list))


class _Saver:
    """Writes binary items into one directory, made only when the first one needs it."""

    def __init__(self, directory: Path | None) -> None:
        self._dir = directory
        self._count = 0

    def save(self, data_b64: str, mime: str | None, stem: str) -> Path:
        try:
            data = base64.b64decode(data_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"not valid base64 ({exc})") from None
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="tether-exec-"))
        self._dir.mkdir(parents=True, exist_ok=True)
        self._count += 1
        ext = (mimetypes.guess_extension(mime.split(";")[0].strip()) if mime else None) or ".bin"
        path = self._dir / f"{self._count}-{_SAFE.sub('_', stem)[:60] or 'item'}{ext}"
        path.write_bytes(data)
        return path


def print_mcp_content(payload: dict[str, Any], save_dir: Path | None) -> None:
    out = console()
    text, structured = payload["text"], payload.get("structured")
    if text and not _is_twin(text, structured):
        out.out(text, end="" if text.endswith("\n") else "\n", highlight=False)
    saver = _Saver(save_dir)
    items = payload.get("content") or payload.get("contents") or []
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        try:
            if kind in ("image", "audio") and isinstance(item.get("data"), str):
                path = saver.save(item["data"], item.get("mimeType"), kind)
                out.out(f"{kind} ({item.get('mimeType', '?')}) saved to {path}", highlight=False)
                continue
            resource = item.get("resource") if kind == "resource" else item
            if isinstance(resource, dict) and isinstance(resource.get("blob"), str):
                path = saver.save(resource["blob"], resource.get("mimeType"), Path(str(resource.get("uri", ""))).name)
                out.out(f"blob {resource.get('uri', '')} ({resource.get('mimeType', '?')}) saved to {path}",
                        highlight=False)
            elif kind == "resource" and isinstance(resource, dict) and isinstance(resource.get("text"), str):
                out.out(f"resource {resource.get('uri', '')}:\n{resource['text']}", highlight=False)
            elif kind == "resource_link":
                server = item.get("server", "SERVER")
                out.out(f"resource_link {item.get('uri', '')} ({item.get('name', '')}); read it with: tether exec "
                        f"mcp.read_resource server={server} uri={item.get('uri', '')}", highlight=False)
        except (OSError, ValueError) as exc:
            out.out(f"{kind or 'item'} not saved: {exc}", highlight=False)
    if structured is not None:
        if isinstance(structured, str):
            out.out(structured, highlight=False)
        else:
            out.print_json(json.dumps(structured, default=str))


def _is_twin(text: str, structured: Any) -> bool:
    """The text only repeats the structured content (as JSON, or the same string): printed once."""
    if structured is None:
        return False
    if text == structured:
        return True
    try:
        return bool(json.loads(text) == structured)
    except ValueError:
        return False
