"""tether's one error tree (`tether.errors`): every exception class defined anywhere in tether derives from
`TetherError` and from the base of the area (package) it lives in, and the tree's top is locked by name and
parent, so a new error cannot be added outside it and the top cannot change by accident."""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
from pathlib import Path

import pytest

import tether
import tether.errors as errors
from tether.errors import (
    AgentError,
    ClientError,
    ConfigError,
    DeviceError,
    ProtocolError,
    SandboxError,
    ServerError,
    TetherError,
    ToolAreaError,
)

ROOT = Path(tether.__file__).parent

# The area base each package's errors derive from: the first part of the module's name below `tether`.
AREAS: dict[str, type[TetherError]] = {
    "protocol": ProtocolError,
    "sandbox": SandboxError,
    "tools": ToolAreaError,
    "device": DeviceError,
    "server": ServerError,
    "agent": AgentError,
    "cli": ClientError,
    "remote": ClientError,
    "client": ClientError,
}


def _module_names() -> list[str]:
    """Every module of tether by its file, namespace packages (folders without `__init__.py`) included;
    `__main__` modules are left out because importing one runs the program."""
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(("tether", *parts)))
    return names


def _defined_errors() -> list[type[BaseException]]:
    found = []
    for name in _module_names():
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


ERRORS = _defined_errors()


def test_the_walk_finds_the_errors_of_every_area() -> None:
    modules = {cls.__module__.split(".")[1] for cls in ERRORS}
    assert {"errors", "protocol", "sandbox", "tools", "device", "server", "agent"} <= modules
    assert len(ERRORS) > 50


@pytest.mark.parametrize("cls", ERRORS, ids=lambda cls: f"{cls.__module__}.{cls.__qualname__}")
def test_every_error_derives_from_tether_error_and_its_area(cls: type[BaseException]) -> None:
    assert issubclass(cls, TetherError), f"{cls.__module__}.{cls.__qualname__} is not a TetherError"
    if cls.__module__ == "tether.errors":
        return
    area = cls.__module__.split(".")[1]
    assert area in AREAS, f"{cls.__module__} is in no area: add its package to AREAS and tether.errors"
    assert issubclass(cls, AREAS[area]), f"{cls.__qualname__} should derive from {AREAS[area].__name__}"


def test_no_error_class_is_out_of_the_walks_sight() -> None:
    """The walk sees classes at a module's top level; one defined inside a function or a class (on a base the
    walk knows: a builtin exception or one of tether's) would escape it, so there is none."""
    known = {cls.__name__ for cls in ERRORS} | {name for name, value in vars(builtins).items()
                                               if isinstance(value, type) and issubclass(value, BaseException)}
    hidden = []
    for path in sorted(ROOT.rglob("*.py")):
        scopes = [node for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
        hidden += [f"{path.relative_to(ROOT)}: {node.name}" for scope in scopes for node in ast.walk(scope)
                   if node is not scope and isinstance(node, ast.ClassDef)
                   and any(ast.unparse(base).rsplit(".", 1)[-1] in known for base in node.bases)]
    assert not hidden, hidden


def test_the_top_of_the_tree() -> None:
    assert TetherError.__bases__ == (Exception,)
    top = {cls.__name__: cls.__bases__ for cls in ERRORS if cls.__module__ == "tether.errors"}
    assert top == {
        "TetherError": (Exception,),
        "ConfigError": (TetherError,),
        "ProtocolError": (TetherError,),
        "SandboxError": (TetherError,),
        "ToolAreaError": (TetherError,),
        "DeviceError": (TetherError,),
        "ServerError": (TetherError,),
        "AgentError": (TetherError,),
        "ClientError": (TetherError,),
    }
    assert sorted(errors.__all__) == sorted(top)


def test_errors_module_imports_nothing() -> None:
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert all(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in imported)


def test_leaves_keep_their_builtin_base() -> None:
    """Code that caught the builtin before the tree existed still catches the same errors."""
    leaves = {cls.__name__: cls for cls in ERRORS}  # by name: they are found wherever their module lives
    FrameError, EscapeError, NoDeviceError = leaves["FrameError"], leaves["EscapeError"], leaves["NoDeviceError"]
    RetriesExhausted, UnsafeBinding = leaves["RetriesExhausted"], leaves["UnsafeBinding"]
    ToolError, PolicyDenied = leaves["ToolError"], leaves["PolicyDenied"]

    assert issubclass(FrameError, ProtocolError) and issubclass(FrameError, ValueError)
    assert issubclass(EscapeError, SandboxError) and issubclass(EscapeError, OSError)
    assert issubclass(NoDeviceError, ServerError) and issubclass(NoDeviceError, LookupError)
    assert issubclass(RetriesExhausted, DeviceError) and issubclass(RetriesExhausted, ConnectionError)
    assert issubclass(UnsafeBinding, ConfigError) and issubclass(UnsafeBinding, ValueError)
    assert issubclass(PolicyDenied, ToolError) and issubclass(ToolError, ToolAreaError)
    error = EscapeError("/x", "a symlink")
    assert isinstance(error, OSError) and error.errno is not None
