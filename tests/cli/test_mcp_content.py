"""One shape for an external MCP tool's result, `{text, content, structured}`, whatever the number of
content items, and how `tether exec` shows it to a person: text as text, images and blobs saved to
files. Against the real `@modelcontextprotocol/server-everything` through `tether exec` processes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.device.test_mcp_resources import config, everything_bin  # noqa: F401 (a fixture)
from tests.kits.netutil import CLI, tether_env

PNG = b"\x89PNG\r\n\x1a\n"


def exec_(tmp_path: Path, binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    state = tmp_path / "state"
    ran = subprocess.run([*CLI, "exec", "--config", str(config(tmp_path, binary)), "--state-dir", str(state), *args],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, env=tether_env(state), timeout=120)
    assert "Traceback" not in ran.stderr, ran.stderr
    return ran


def as_json(ran: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return json.loads(ran.stdout)["result"]


def test_one_shape_whatever_the_number_of_items(tmp_path: Path, everything_bin: Path) -> None:  # noqa: F811
    image = as_json(exec_(tmp_path, everything_bin, "get-tiny-image", "--json"))
    assert image.keys() == {"text", "content", "structured"} and image["structured"] is None
    assert [item["type"] for item in image["content"]] == ["text", "image", "text"]
    assert image["text"] == "\n".join(item["text"] for item in image["content"] if item["type"] == "text")
    assert image["content"][1]["mimeType"] == "image/png" and image["content"][1]["data"]

    one = as_json(exec_(tmp_path, everything_bin, "echo", "message=hi", "--json"))
    assert one == {"text": "Echo: hi", "content": [{"type": "text", "text": "Echo: hi"}], "structured": None}

    weather = as_json(exec_(tmp_path, everything_bin, "get-structured-content", "location=Chicago", "--json"))
    assert weather["structured"].keys() == {"temperature", "conditions", "humidity"}
    assert json.loads(weather["text"]) == weather["structured"]  # the text twin is kept


def test_images_are_saved_and_text_printed_as_text(tmp_path: Path, everything_bin: Path) -> None:  # noqa: F811
    saved = tmp_path / "saved"
    ran = exec_(tmp_path, everything_bin, "get-tiny-image", "--save-dir", str(saved))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    [png] = saved.iterdir()
    assert png.suffix == ".png" and png.read_bytes().startswith(PNG)
    assert f"image (image/png) saved to {png}" in ran.stdout
    assert "Here's the image you requested:\n" in ran.stdout and '"data"' not in ran.stdout

    default = exec_(tmp_path, everything_bin, "get-tiny-image")
    assert default.returncode == 0, default.stdout + default.stderr
    where = Path(re.search(r"saved to (\S+)", default.stdout)[1])  # type: ignore[index]
    try:
        assert where.read_bytes().startswith(PNG) and where.parent.name.startswith("tether-exec-")
    finally:
        shutil.rmtree(where.parent)

    blob = exec_(tmp_path, everything_bin, "mcp.read_resource", "uri=demo://resource/dynamic/blob/3",
                 "--save-dir", str(saved))
    assert blob.returncode == 0, blob.stdout + blob.stderr
    [txt] = [p for p in saved.iterdir() if p != png]
    assert txt.read_bytes().startswith(b"Resource 3: This is a base64 blob") and str(txt) in blob.stdout

    words = exec_(tmp_path, everything_bin, "echo", "message=line one\nline two [b]x[/b] revision=[/x]")
    assert words.returncode == 0, words.stdout + words.stderr
    assert "\nEcho: line one\nline two [b]x[/b] revision=[/x]\n" in words.stdout  # text, never markup

    links = exec_(tmp_path, everything_bin, "get-resource-links", "count:=1")
    assert ("resource_link demo://resource/dynamic/blob/1 (Blob Resource 1); read it with: tether exec "
            "mcp.read_resource server=everything uri=demo://resource/dynamic/blob/1") in links.stdout
