"""Built-in tools as plain async functions: schema from the signature, validation, timeout, errors.

A tool is an `async def` decorated with `@tool(...)`. Its parameters (other than `ctx`) become the
JSON schema an LLM sees and the strict validator every call goes through, so a wrong argument is a
clear `Result(status=failure)` naming the tool and the argument, never an exception or a hang.
Calls go straight to the function: no MCP session, thread or event loop per call.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model

from tether.protocol.models import Result, ResultStatus, ToolInfo, ToolType
from tether.tools.context import ToolContext
from tether.tools.errors import ToolError

logger = logging.getLogger(__name__)

ToolFunction = Callable[..., Awaitable[Any]]
_SPEC_ATTR = "__tether_tool__"


class _StrictArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, arbitrary_types_allowed=False)


@dataclass(frozen=True, slots=True)
class _Schemas:
    """What a tool's signature becomes: the model its arguments are validated with, and the JSON schemas."""

    params_model: type[BaseModel]
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None


@dataclass(frozen=True)
class ToolSpec:
    """Everything the runtime needs to validate and run one tool. Made at decoration from the signature (the
    name, type and description, whether it takes `ctx`; *args/**kwargs refused there); the argument model
    and the JSON schemas are built from the type hints the first time one of them is read (`params_model`,
    `input_schema`, `output_schema`), once: a tool that is never listed or called never builds them. Reading
    one raises what building it raises (NameError for a hint that names nothing, pydantic's schema errors)."""

    name: str
    tool_type: ToolType
    description: str
    fn: ToolFunction
    timeout: float | None
    takes_ctx: bool
    meta: bool = False  # plumbing a server drives (e.g. the transfer chunks): callable, but not listed to planners

    @cached_property
    def _schemas(self) -> _Schemas:
        return _build_schemas(self.fn, self.name)

    @property
    def params_model(self) -> type[BaseModel]:
        """The strict pydantic model of the tool's arguments (built on first use)."""
        return self._schemas.params_model

    @property
    def input_schema(self) -> dict[str, Any]:
        """The arguments' JSON schema, as planners and MCP clients read it (built on first use)."""
        return self._schemas.input_schema

    @property
    def output_schema(self) -> dict[str, Any] | None:
        """The result's JSON schema when the return type is a model or a TypedDict, else None."""
        return self._schemas.output_schema

    def info(self, namespace: str) -> ToolInfo:
        return ToolInfo(name=self.name, namespace=namespace, tool_type=self.tool_type,
                        description=self.description, input_schema=self.input_schema,
                        output_schema=self.output_schema, meta=self.meta)


def tool(name: str | None = None, *, tool_type: ToolType, timeout: float | None = None,
         description: str | None = None, meta: bool = False) -> Callable[[ToolFunction], ToolFunction]:
    """Mark an async function as a tool. The function itself is returned unchanged (callable in tests).
    `meta`: the device runs it when asked, but leaves it out of the tool lists planners and MCP clients read."""

    def decorate(fn: ToolFunction) -> ToolFunction:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"tool {fn.__name__} must be an async function")
        setattr(fn, _SPEC_ATTR, build_spec(fn, name or fn.__name__, tool_type, timeout, description, meta=meta))
        return fn

    return decorate


def build_spec(fn: ToolFunction, name: str, tool_type: ToolType, timeout: float | None,
               description: str | None, *, meta: bool = False) -> ToolSpec:
    """The spec of `fn` as tool `name`; its argument model and schemas are built when first read (`ToolSpec`).
    Raises TypeError for *args/**kwargs."""
    takes_ctx = False
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "ctx":
            takes_ctx = True
        elif param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name}: *args/**kwargs are not allowed (schemas must be explicit)")
    doc = description or inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
    return ToolSpec(name=name, tool_type=tool_type, description=doc, fn=fn, timeout=timeout, takes_ctx=takes_ctx,
                    meta=meta)


def _build_schemas(fn: ToolFunction, name: str) -> _Schemas:
    hints = typing.get_type_hints(fn, include_extras=True)
    fields: dict[str, Any] = {}
    for pname, param in inspect.signature(fn).parameters.items():
        if pname == "ctx":
            continue
        annotation = hints.get(pname, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (annotation, default)
    model = create_model(f"{name.replace('.', '_')}_args", __base__=_StrictArgs, **fields)
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    output_schema = None
    ret = hints.get("return")
    if ret is not None and ret is not Any and isinstance(ret, type) and _is_structured(ret):
        output_schema = TypeAdapter(ret).json_schema()
    return _Schemas(params_model=model, input_schema=schema, output_schema=output_schema)


def _is_structured(tp: type) -> bool:
    return issubclass(tp, BaseModel) or typing.is_typeddict(tp)


def spec_of(fn: ToolFunction) -> ToolSpec:
    spec = getattr(fn, _SPEC_ATTR, None)
    if spec is None:
        raise TypeError(f"{fn!r} is not a tool (decorate it with @tool)")
    return spec


def format_validation_error(tool_name: str, exc: ValidationError) -> str:
    """One line per bad argument, each naming the argument: what a planner needs to patch the call."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        if err["type"] == "missing":
            parts.append(f"missing required argument '{loc}'")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown argument '{loc}'")
        else:
            parts.append(f"argument '{loc}': {err['msg']} (got {_short(err.get('input'))})")
    return f"{tool_name}: invalid arguments: " + "; ".join(parts)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class ToolSet:
    """A namespace of built-in tools, called in-process with validation and a timeout per call."""

    def __init__(self, namespace: str, functions: Iterable[ToolFunction], description: str = "",
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.namespace = namespace
        self.description = description
        self.on_close = on_close  # releases what the tools hold (e.g. a browser); called by `aclose`
        self.specs: dict[str, ToolSpec] = {}
        for fn in functions:
            spec = spec_of(fn)
            if spec.name in self.specs:
                raise ValueError(f"tool set {namespace}: duplicate tool {spec.name}")
            self.specs[spec.name] = spec

    def infos(self) -> list[ToolInfo]:
        return [spec.info(self.namespace) for spec in self.specs.values()]

    async def aclose(self) -> None:
        """Release what the tool set holds (processes, browsers); safe to call more than once."""
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            await on_close()

    async def call(self, name: str, arguments: Mapping[str, Any] | None, ctx: ToolContext,
                   timeout: float | None = None) -> Result:
        spec = self.specs.get(name)
        if spec is None:
            return Result(status=ResultStatus.FAILURE, namespace=self.namespace, call_id=ctx.call_id,
                          error=f"unknown tool '{name}' in namespace '{self.namespace}'")
        return await call_spec(spec, self.namespace, arguments, ctx, timeout)


async def call_spec(spec: ToolSpec, namespace: str, arguments: Mapping[str, Any] | None,
                    ctx: ToolContext, timeout: float | None = None) -> Result:
    """Validate, run under a deadline, and turn every outcome into a `Result`."""
    call_id = ctx.call_id
    try:
        args = spec.params_model.__pydantic_validator__.validate_python(arguments or {}).__dict__
    except ValidationError as exc:
        return Result(status=ResultStatus.FAILURE, error=format_validation_error(spec.name, exc),
                      namespace=namespace, call_id=call_id)
    limit = timeout or spec.timeout or ctx.policy.default_timeout
    try:
        if ctx.deadline is not None and asyncio.get_running_loop().time() + limit > ctx.deadline:
            # the caller's timeout fires first and cancels the call, as this one would: no second timer
            value = await (spec.fn(ctx, **args) if spec.takes_ctx else spec.fn(**args))
        else:
            async with asyncio.timeout(limit):
                value = await (spec.fn(ctx, **args) if spec.takes_ctx else spec.fn(**args))
    except TimeoutError:
        return Result(status=ResultStatus.FAILURE, namespace=namespace, call_id=call_id,
                      error=f"{spec.name}: timed out after {limit:g}s (everything it started was killed)",
                      result={"timed_out": True, "timeout": limit})
    except ToolError as exc:
        return Result(status=ResultStatus.FAILURE, error=f"{spec.name}: {exc}", result=exc.result,
                      namespace=namespace, call_id=call_id)
    except Exception as exc:
        logger.exception("tool %s crashed", spec.name)
        return Result(status=ResultStatus.FAILURE, namespace=namespace, call_id=call_id,
                      error=f"{spec.name}: internal error: {type(exc).__name__}: {exc}")
    return Result(status=ResultStatus.SUCCESS, result=value, namespace=namespace, call_id=call_id)
