"""Creating a task (choosing its device within the creator's scope) and planning one without running it."""

from __future__ import annotations

from tether.agent.planning.plan import Plan, PlanStep
from tether.agent.run.executor import TaskRunner
from tether.agent.run.task import Task, TaskAsker
from tether.agent.tasks.errors import TaskError
from tether.agent.tasks.service.running import DeviceUnavailable, Running
from tether.protocol.profile import DeviceRequirements
from tether.server.aip.fleet.matching import NoDeviceError
from tether.server.aip.fleet.scopes import beyond, unknown_device
from tether.server.aip.fleet.scopes import within as scope_within
from tether.server.store import StoreUnavailable
from tether.server.store.tokens import TokenInfo
from tether.server.trust.sessions import task_owner


class Creating(Running):
    """The task service's creation and dry run."""

    async def create(self, request: str, *, plan: Plan | None = None, device: str | None = None,
                     requires: DeviceRequirements | None = None, devices: list[str] | None = None,
                     requested_by: str | None = None, confirm: str = "never", token: TokenInfo | None = None) -> Task:
        """Create a task on `device` (or on the device `requires` selects) and start it. `confirm`
        (never|destructive|always, the creating token's setting) makes it wait for its plan's confirmation.
        `token` (the creator's): a scoped one's task reaches only the devices in its scope, now and at every
        step (the device chosen, the devices named, a step `on: all`), and it keeps that scope after a restart;
        the task acts for it (`Task.asker`, saved with the task): the questions its steps' MCP servers ask are
        that token's, as a plain command's are its caller's (`approvals.check_answerer`)."""
        if self._closing:
            raise TaskError(503, "the server is shutting down")
        if not request and (plan is None or not plan.steps):
            raise TaskError(422, "give a request in plain words, or a plan with at least one step")
        if plan is None and self.llm is None:
            raise TaskError(409, "this server has no LLM configured, so it cannot plan a request; give a plan "
                                 "instead, or start the server with TETHER_LLM_BASE_URL and TETHER_LLM_MODEL set")
        target = self._pick(device, requires, token)
        extra = list(dict.fromkeys([*(devices or []), *(s.device for s in (plan.steps if plan else []) if s.device)]))
        for name in extra:
            self._in_scope(token, name, "a device the task names")
            if self.registry.get(name) is None:
                raise TaskError(404, f"the plan names device '{name}', which has never registered")
        task = Task(request=request or "run the given plan", plan=plan, device=target, requested_by=requested_by,
                    devices=[n for n in extra if n != target], confirm=confirm,
                    scope_devices=list(token.devices) if token is not None else [],
                    scope_tags=list(token.tags) if token is not None else [],
                    asker=TaskAsker(name=token.name, agent=token.agent, sample=token.allows("sample"))
                    if token is not None else None)
        unaudited = self.server_store.audit.problem()
        if unaudited is not None:  # its commands could not be audited, so they would not run
            raise TaskError(503, f"no task was created: {unaudited}")
        remote = self.hub.remote
        away = [n for n in (target, *task.devices) if not self.hub.holds(n)] if remote is not None else []
        # a cluster node cut off from its backplane
        if away and remote is not None and (problem := remote.problem()) is not None:
            raise TaskError(503, f"no task was created: {problem}; device {away[0]} is not connected to this node")
        try:
            owner = await self.server_store.call(self.server_store.sessions.claim, task.id, task_owner(task.id))
            if owner != task_owner(task.id):
                raise TaskError(409, f"session {task.id} is already taken; create the task again")
            await self.store.saved(task)
        except StoreUnavailable as exc:
            raise TaskError(503, f"no task was created: {exc}") from None
        self._start(task)
        return task

    async def dry_run(self, request: str, *, plan: Plan | None = None, device: str | None = None,
                      requires: DeviceRequirements | None = None, devices: list[str] | None = None,
                      token: TokenInfo | None = None) -> tuple[str, list[PlanStep], list[str]]:
        """(the device, the plan, its problems) for a task that is planned or checked and never run."""
        if not request and (plan is None or not plan.steps):
            raise TaskError(422, "give a request in plain words, or a plan with at least one step")
        if plan is None and self.llm is None:
            raise TaskError(409, "this server has no LLM configured, so it cannot plan a request; give a plan")
        target = self._pick(device, requires, token)
        for name in [*(devices or []), *(s.device for s in (plan.steps if plan else []) if s.device)]:
            self._in_scope(token, name, "a device the task names")
        task = Task(request=request or "run the given plan", plan=plan, device=target, devices=list(devices or []),
                    scope_devices=list(token.devices) if token is not None else [],
                    scope_tags=list(token.tags) if token is not None else [])
        runner = TaskRunner(lambda name: self._dispatcher(task, name), self.llm, tools={}, ask=self._asker(task),
                            budgets=self.budgets, default_device=target)
        try:
            runner.tools = await self._tools_for(task)
        except DeviceUnavailable as exc:
            raise TaskError(409, str(exc)) from None
        runner.profiles = {name: record.profile for name in runner.tools if name is not None
                           and (record := self.registry.get(name)) is not None and record.profile is not None}
        problems = await runner.dry_run(task)
        return target, list(task.plan.steps) if task.plan is not None else [], problems

    def _in_scope(self, token: TokenInfo | None, name: str, what: str) -> None:
        """404 (as for a device that never registered) when a scoped token does not reach `name`."""
        if token is not None and token.scoped:
            record = self.registry.get(name)
            if not token.reaches(name, record.tags if record is not None else ()):
                raise TaskError(404, f"{what}: {unknown_device(token, name)}")

    def _pick(self, device: str | None, requires: DeviceRequirements | None, token: TokenInfo | None = None) -> str:
        if device is not None:
            self._in_scope(token, device, "the task's device")
            record = self.registry.get(device)
            if record is None:
                raise TaskError(404, f"no device named '{device}'")
            if record.status == "offline":
                raise TaskError(409, f"device '{device}' is offline")
            return device
        try:
            return self.registry.select(requires or DeviceRequirements(),
                                            scope_within(token) if token is not None else None).name
        except NoDeviceError as exc:
            raise TaskError(409, str(exc) + (beyond(token) if token is not None else "")) from None
