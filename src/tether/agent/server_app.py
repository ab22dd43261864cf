"""The agent server: the device server's app plus tasks (planning, running, recovering, the task API)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from tether.agent.llm.chat import LLMClient
from tether.agent.llm.sampling import DeviceSampler
from tether.agent.llm.settings import LLMSettings
from tether.agent.run.task import Budgets
from tether.agent.tasks.api.inbox import inbox_router
from tether.agent.tasks.api.mcp_task_bridge import with_tasks
from tether.agent.tasks.api.mcp_tools import task_tools
from tether.agent.tasks.api.task_api import router, task_error
from tether.agent.tasks.service import TaskError, TaskService
from tether.agent.tasks.store import TaskStore
from tether.server.http.app import Extension, create_app
from tether.server.mcp.contributed import contribute
from tether.server.settings import ServerSettings
from tether.server.store import Store


def tasks_extension(llm: LLMClient | None, budgets: Budgets | None = None) -> Extension:
    """An app extension (see `create_app`) that runs tasks with `llm` (None: plans must be given); they live
    in the server's database file. The task service closes `llm` when the app stops."""

    def extend(app: FastAPI) -> AbstractAsyncContextManager[None]:
        app.include_router(router)
        app.include_router(inbox_router)  # GET /api/v1/approvals: what waits for a person (docs/approvals.md)
        app.add_exception_handler(TaskError, task_error)
        contribute(app, with_tasks(app, task_tools(app)))  # run_task (also as an MCP task), get_task, … at /mcp

        @asynccontextmanager
        async def running() -> AsyncIterator[None]:
            settings: ServerSettings = app.state.settings
            # opened off the event loop: with PostgreSQL it connects and creates its tables (the hub and a
            # cluster node's heartbeats already run on the loop)
            store = await asyncio.to_thread(TaskStore, settings.db_target)
            service = TaskService(app.state.hub, app.state.registry, store, llm, server_store=app.state.store,
                                  budgets=budgets, transfers=app.state.transfers,
                                  notifier=getattr(app.state, "notifier", None))
            app.state.tasks = service
            app.state.on_stopping = [*getattr(app.state, "on_stopping", []), service.release_followers]
            await service.start()
            try:
                yield
            finally:
                await service.aclose()
                store.close()

        return running()

    return extend


def create_agent_app(settings: ServerSettings, store: Store | None = None, *,
                     llm_settings: LLMSettings | None = None, budgets: Budgets | None = None) -> FastAPI:
    """The full agent server; `llm_settings` None means plans must be given (no planning). With an LLM,
    devices' external MCP servers may sample it too, as their policies allow (`DeviceSampler`)."""
    llm = LLMClient(llm_settings) if llm_settings is not None else None
    return create_app(settings, store, extensions=[tasks_extension(llm, budgets)],
                      sampler=DeviceSampler(llm) if llm is not None else None)
