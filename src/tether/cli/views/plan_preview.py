"""`tether run --dry-run`: plan a request (or check a plan file) against this machine's tools and show
the plan, running nothing and storing nothing, so a plan can be read before it is trusted."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from tether.cli.common import console

if TYPE_CHECKING:
    from tether.device.config import DeviceConfig


async def dry_run_local(request: str, plan: Any, settings: Any, config: DeviceConfig, policy: Path | None,
                        state_dir: Path | None) -> int:
    """0 with the plan shown when it would run; 1 with its problems listed. The caller holds the state
    directory's lock (`tether.cli.guards.state_lock.holding_state_dir`)."""
    from tether.agent.llm.chat import LLMClient
    from tether.agent.run.confirm import plan_text
    from tether.agent.run.executor import DEFAULT_DEVICE_NAME, TaskRunner
    from tether.agent.run.task import Task
    from tether.device.local import open_local_device
    from tether.device.probe import collect_profile

    out = console()
    llm = LLMClient(settings) if settings is not None else None

    async def never_asked(question: Any) -> str:  # a dry run asks nothing
        raise AssertionError("a dry run asked a question")

    try:
        async with open_local_device(config, policy_path=policy, state_dir=state_dir,
                                     lock_state_dir=False) as device:  # its caller holds the state directory
            computer = await device.computer_manager.get_or_create(None)
            dispatcher = device.dispatcher(session_id="dry-run")
            profiles = {DEFAULT_DEVICE_NAME: await collect_profile(device)} if llm is not None else {}
            runner = TaskRunner(lambda _device: dispatcher, llm, tools={None: computer.tool_infos()},
                                ask=never_asked, profiles=profiles)
            task = Task(request=request, plan=plan)
            problems = await runner.dry_run(task)
    finally:
        if llm is not None:
            await llm.close()
    if task.plan is not None and task.plan.steps:
        out.print("plan (dry run, nothing ran):", highlight=False)
        out.print(plan_text(task.plan.steps), highlight=False, markup=False)
    if problems:
        console(err=True).print("error: the plan has problems:\n" + "\n".join(f"- {p}" for p in problems),
                                markup=False, soft_wrap=True)
        return 1
    return 0


def dry_run_remote(client: Any, request: str, steps: list[dict[str, Any]] | None, device: str | None,
                   requires: dict[str, Any] | None, also: list[str]) -> int:
    """The server's dry run (POST /tasks/dry-run): 0 with the plan shown, 1 with its problems listed."""
    from tether.agent.planning.plan import PlanStep
    from tether.agent.run.confirm import plan_text
    from tether.cli.common import ExitCode, fail_remote
    from tether.client.rest import RemoteError

    try:
        found = client.dry_run_task(request, plan=steps, device=device, requires=requires, devices=also)
    except RemoteError as exc:
        fail_remote(exc, ExitCode.USAGE)
    planned = [PlanStep.model_validate(s) for s in found.get("plan") or []]
    out = console()
    if planned:
        out.print(f"plan for {found.get('device')} (dry run, nothing ran):", highlight=False, markup=False)
        out.print(plan_text(planned), highlight=False, markup=False)
    problems = list(found.get("problems") or [])
    if problems:
        console(err=True).print("error: the plan has problems:\n" + "\n".join(f"- {p}" for p in problems),
                                markup=False, soft_wrap=True)
        return 1
    return 0
