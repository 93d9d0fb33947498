"""Multi-turn environments: tools a model calls, the text formats of calls and results,
and a registry of environments by name.

Built-in environments (each takes `format` — a `ToolFormat` or a name, "hermes" by
default; the number of calls a turn may hold is the format's `max_calls` — plus
`ToolEnvironment`'s keyword options; the Python ones also `sandbox`):
"calculator" (`CalculatorTool`), "python" (`PythonTool`) and "tools" (both).

The calculator judges its trajectories' tool use (`EnvStep.tool_correct`, by
`tool_result_is_answer`: a call returned the record's answer and the final answer is that
result; `judge=None` turns it off); "python" and "tools" cannot tell (None): a program's
output or a mix of tools need not be the answer.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from rlax_data.envs.environment import (
    TOOL_MESSAGE_SEPARATOR,
    Environment,
    EnvStep,
    ToolEnvironment,
    ToolUseJudge,
    final_answer_line,
    tool_result_is_answer,
)
from rlax_data.envs.formats import (
    BracketToolFormat,
    HermesToolFormat,
    Llama3JsonToolFormat,
    MalformedCall,
    MistralToolFormat,
    ParsedCall,
    ToolCallError,
    ToolFormat,
    make_tool_format,
    tool_format_for_template,
    tool_format_names,
)
from rlax_data.envs.tools import (
    TOOL_ERROR_KINDS,
    CalculatorTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
    ToolThreads,
    run_tool,
    run_tools,
)
from rlax_data.verify.sandbox import Sandbox, SandboxConfig

__all__ = [
    "TOOL_ERROR_KINDS",
    "TOOL_MESSAGE_SEPARATOR",
    "BracketToolFormat",
    "CalculatorTool",
    "EnvStep",
    "Environment",
    "EnvironmentFactory",
    "HermesToolFormat",
    "Llama3JsonToolFormat",
    "MalformedCall",
    "MistralToolFormat",
    "ParsedCall",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolCallError",
    "ToolEnvironment",
    "ToolError",
    "ToolFormat",
    "ToolResult",
    "ToolThreads",
    "ToolUseJudge",
    "environment_names",
    "final_answer_line",
    "make_environment",
    "make_tool_format",
    "register_environment",
    "run_tool",
    "run_tools",
    "tool_format_for_template",
    "tool_result_is_answer",
    "tool_format_names",
]

EnvironmentFactory = Callable[..., Environment]
"""Makes one environment (for one trajectory) from keyword options."""

_REGISTRY: dict[str, EnvironmentFactory] = {}
_LOCK = threading.Lock()


def register_environment(name: str, factory: EnvironmentFactory) -> None:
    """Make `factory(**kwargs)` available as `make_environment(name, **kwargs)`.

    A name can be registered once: a second registration is an error, not a silent
    replacement of an environment other code relies on."""
    if not name or not isinstance(name, str):
        raise ValueError(f"register_environment: name must be a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"register_environment: the factory of {name!r} is not callable")
    with _LOCK:
        if name in _REGISTRY:
            raise ValueError(f"register_environment: {name!r} is already registered")
        _REGISTRY[name] = factory


def environment_names() -> list[str]:
    with _LOCK:
        return sorted(_REGISTRY)


def make_environment(name: str, **kwargs: Any) -> Environment:
    """A new environment (one per trajectory) of the registered kind `name`, or made by the
    factory that `name` points to as `"package.module:attribute"` (a user's own code,
    imported on every node that makes environments, as `agent.environment` allows)."""
    with _LOCK:
        factory = _REGISTRY.get(name)
        known = sorted(_REGISTRY)
    if factory is None and ":" in name:
        factory = _import_factory(name)
    if factory is None:
        raise ValueError(f"environment: {name!r} is not one of {known} (or a 'package.module:factory' path)")
    return factory(**kwargs)


def _import_factory(path: str) -> EnvironmentFactory:
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"environment: {path!r}: cannot import {module_name!r}: {error}") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"environment: {path!r}: {module_name!r} has no callable {attribute!r}")
    return factory  # type: ignore[no-any-return]


def _tool_environment(
    name: str, tools: list[Tool], *, format: ToolFormat | str = "hermes", **options: Any
) -> ToolEnvironment:
    fmt = make_tool_format(format) if isinstance(format, str) else format
    return ToolEnvironment(tools, fmt, name=name, **options)


def _calculator(**options: Any) -> ToolEnvironment:
    # The record's answer is what a right call returns: the calculator can judge its tool use.
    return _tool_environment("calculator", [CalculatorTool()], **{"judge": tool_result_is_answer, **options})


def _python(*, sandbox: SandboxConfig | Sandbox | None = None, **options: Any) -> ToolEnvironment:
    return _tool_environment("python", [PythonTool(sandbox)], **options)


def _tools(*, sandbox: SandboxConfig | Sandbox | None = None, **options: Any) -> ToolEnvironment:
    return _tool_environment("tools", [CalculatorTool(), PythonTool(sandbox)], **options)


register_environment("calculator", _calculator)
register_environment("python", _python)
register_environment("tools", _tools)
