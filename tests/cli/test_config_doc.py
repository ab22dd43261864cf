"""issue 12: docs/configuration.md lists every key of the config file and the policy with its default, generated
from the models (stale or incomplete fails here), the README links it, and the README's REST table lists every
task endpoint with its scope."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from tether.cli import docgen

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"


def test_the_committed_reference_is_what_the_models_generate() -> None:
    done = subprocess.run([sys.executable, "-m", "tether.cli.docgen", "--check"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert DOC.read_text(encoding="utf-8") == docgen.render()


def test_every_field_of_every_model_is_in_the_reference() -> None:
    text = DOC.read_text(encoding="utf-8")
    seen = 0
    for section in docgen.SECTIONS:
        todo: list[tuple[str, type]] = [(section.prefix, docgen._load(section.model))]
        while todo:
            prefix, model = todo.pop(0)
            for name, field in model.model_fields.items():  # type: ignore[attr-defined]
                if field.exclude:
                    continue
                row = re.search(rf"^\| `{re.escape(prefix + name)}` \| [^|]+(?:\\\|[^|]+)* \| (.+?) \| (.+) \|$",
                                text, re.MULTILINE)
                assert row, f"{model.__name__}.{name} ({prefix}{name}) is not in {DOC.name}"
                assert row.group(1).strip() and row.group(2).strip()  # a default and a line
                seen += 1
                inner = docgen._model_in(field.annotation)
                if inner is not None:
                    todo.append((f"{prefix}{name}{inner[0]}", inner[1]))
    assert seen > 80  # the policy, device, server endpoint, MCP entry, LLM and server settings all walked
    for key in ("`llm.model`", "`device.tags`", "`write_roots`", "`commands.<name>.deny_args`",
                "`approval.delete`", "`heartbeat_interval`", "`mcp.<agent>.<root>.action[].command`"):
        assert key in text


def test_a_field_without_a_description_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    class Probe(BaseModel):
        described: int = Field(3, description="has its line")
        bare: str = "x"

    monkeypatch.setattr(docgen, "_load", lambda spec: Probe)
    with pytest.raises(ValueError, match=r"Probe\.bare has no description"):
        docgen.render()
    monkeypatch.setitem(docgen.NOTES, "Probe.bare", "now it has one")
    assert "| `bare` | str | `'x'` | now it has one |" in docgen.render()


def test_the_readme_links_the_reference() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/configuration.md)" in readme


def test_the_readme_rest_table_lists_every_task_endpoint_with_its_scope() -> None:
    from tether.agent.tasks.api.task_api import router

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### REST API", 1)[1].split("\n#", 1)[0]
    routes = [(method, route.path.replace("{task_id}", "{id}"))  # type: ignore[attr-defined]
              for route in router.routes for method in sorted(route.methods)]  # type: ignore[attr-defined]
    assert len(routes) >= 9
    for method, path in routes:
        row = re.search(rf"^\| `{method} {re.escape(path)}` \| (\w+) \| .+ \|$", table, re.MULTILINE)
        assert row, f"{method} {path} is not in the README's REST table"
        assert row.group(1) in ("read", "execute", "approve", "admin")
