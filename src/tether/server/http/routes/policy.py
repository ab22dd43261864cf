"""REST routes for a device's policy: show it (`read`), change it (`admin`). See `policy_push`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from tether.server.aip.policy_push import PolicyRequestFailed, change, show
from tether.server.http.api import ERROR_RESPONSES, _hub, _record, _registry, _store, require
from tether.server.store.tokens import TokenInfo

policy_router = APIRouter(prefix="/api/v1", responses=ERROR_RESPONSES)

# `\s` differs between Python (adds \x1c-\x1f and \x85) and JSON Schema's ECMA regexes (adds \ufeff): both
# named, so the document's pattern and the server's check refuse the same programs (tests/fuzz found \x85)
_PROGRAM = r"^[^/\s\x00\x1c-\x1f\x85\ufeff]{1,200}$"


class PolicyReport(BaseModel):
    version: int = Field(description="how many remote changes the device has applied")
    policy: dict[str, Any] = Field(description="the effective policy")
    sources: dict[str, Any] = Field(description="where each value comes from: default, file or remote")
    remote_allowed: bool = Field(description="whether the device takes changes from its server (policy_remote)")


class PolicyChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    policy: dict[str, Any] = Field(description="settings to set; commands: {program: rule, or null to remove}")
    replace: bool = Field(False, description="replace every earlier remote change instead of adding to them")


class ProgramChange(BaseModel):
    model_config = ConfigDict(extra="forbid")

    program: str = Field(pattern=_PROGRAM, description="a program's basename, e.g. git")


async def _call(coro: Any) -> PolicyReport:
    try:
        return PolicyReport.model_validate(await coro)
    except PolicyRequestFailed as exc:
        raise HTTPException(exc.status, str(exc)) from None


@policy_router.get("/devices/{name}/policy", response_model=PolicyReport)
async def get_policy(name: str, request: Request,
                     who: Annotated[TokenInfo, Depends(require("read"))]) -> PolicyReport:
    """The device's effective policy, asked live, with where each value comes from."""
    _record(_registry(request), name, who)
    return await _call(show(_hub(request), name))


@policy_router.put("/devices/{name}/policy", response_model=PolicyReport)
async def put_policy(name: str, body: PolicyChange, request: Request,
                     who: Annotated[TokenInfo, Depends(require("admin"))]) -> PolicyReport:
    """Change the device's policy; the device applies and persists it, and answers its new version."""
    _record(_registry(request), name, who)
    return await _call(change(_hub(request), name, body.policy, replace=body.replace, requested_by=f"api:{who.name}",
                              audit=_store(request).audit))


@policy_router.post("/devices/{name}/policy/{verb}", response_model=PolicyReport)
async def program_policy(name: str, verb: Literal["allow", "deny", "approve"], body: ProgramChange,
                         request: Request, who: Annotated[TokenInfo, Depends(require("admin"))]) -> PolicyReport:
    """`allow` adds the program to the allowlist (no argument rules: give those with PUT), `deny`
    removes it, `approve` allows it with a person's approval needed on every run (keeping its rules)."""
    rule: dict[str, Any] | None = {"allow": {}, "deny": None, "approve": {"approve": True}}[verb]
    _record(_registry(request), name, who)
    return await _call(change(_hub(request), name, {"commands": {body.program: rule}}, replace=False,
                              requested_by=f"api:{who.name}", audit=_store(request).audit))
