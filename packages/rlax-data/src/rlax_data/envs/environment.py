"""Environments a model acts in over several turns, and the tool-calling one.

The worker makes one environment per trajectory: `reset(record)` gives the first
observation (the prompt the model sees), then each model turn goes to `step`, whose
`EnvStep` holds the next observation (an environment turn the model reads) or ends the
trajectory. Steps of different trajectories may run at once in a thread pool, so an
environment keeps no state shared with others (tools are stateless, or thread-safe like
the shared sandbox).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rlax_data.datasets import Record
from rlax_data.envs.formats import ToolCallError, ToolFormat
from rlax_data.envs.tools import Tool, ToolResult, run_tool

__all__ = ["EnvStep", "Environment", "ToolEnvironment"]


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn.

    observation: the next environment turn ("" when done). reward: None lets the run's
    verifier score the final answer. tool_calls / tool_errors: calls made / failed in this
    step (0 or 1 each for tool environments; every result with an error kind is a failed
    call, a truncated one included). error: the `ToolResult.error` kind of this step (""
    for a plain result), so the metrics count each kind.
    """

    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    error: str = ""


@runtime_checkable
class Environment(Protocol):
    name: str

    def reset(self, record: Record) -> str:
        """Start a trajectory for `record`; the first observation (the prompt text)."""
        ...

    def step(self, model_turn: str) -> EnvStep:
        """React to one model turn (its text, the stop string included)."""
        ...


class ToolEnvironment:
    """The model calls tools until it writes a turn without a call: its final answer.

    Each model turn is parsed by `format`: no call ends the trajectory (reward None: the
    verifier scores the answer); a call runs through `run_tool` and its rendered result is
    the next observation; a malformed call is answered with an error observation and the
    trajectory goes on. The number of turns is the caller's to bound.

    max_result_chars: longest tool output shown before it is cut. tool_timeout_s: limit
    per call (None: each tool's own `time_limit_s`). instructions: text put before the
    record's prompt (say, how to call the tools, for a model without a tool-aware chat
    template).

    A step depends on its turn alone (`independent_steps`): an environment run in the
    verifier service (`rlax_data.envs.remote`) is not replayed up to the turn it answers.
    """

    independent_steps = True

    def __init__(
        self,
        tools: Sequence[Tool],
        format: ToolFormat,
        *,
        max_result_chars: int = 4096,
        tool_timeout_s: float | None = None,
        instructions: str = "",
        name: str = "tools",
    ) -> None:
        if not tools:
            raise ValueError("ToolEnvironment: `tools` must hold at least one tool")
        names = [t.name for t in tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"ToolEnvironment: tool names must be unique, got {duplicates} more than once")
        if max_result_chars < 1:
            raise ValueError(f"ToolEnvironment: max_result_chars must be >= 1, got {max_result_chars}")
        if tool_timeout_s is not None and not tool_timeout_s > 0:
            raise ValueError(f"ToolEnvironment: tool_timeout_s must be > 0 (or None), got {tool_timeout_s}")
        self.name = name
        self.tools = {t.name: t for t in tools}
        self.format = format
        self.max_result_chars = max_result_chars
        self.tool_timeout_s = tool_timeout_s
        self.instructions = instructions
        self._done = False

    def reset(self, record: Record) -> str:
        self._done = False
        return self.instructions + record.prompt_text()

    def step(self, model_turn: str) -> EnvStep:
        if self._done:
            raise RuntimeError(f"environment {self.name!r}: step after the trajectory ended; reset it first")
        try:
            call = self.format.parse(model_turn)
        except ToolCallError as e:
            result = ToolResult(text=f"Error: malformed tool call: {e}", ok=False, error="malformed")
            return EnvStep(self.format.render_result(result), done=False, tool_errors=1, error="malformed")
        if call is None:
            self._done = True
            return EnvStep("", done=True)
        tool = self.tools.get(call.name)
        timeout = self.tool_timeout_s or (tool.time_limit_s if tool is not None else 1.0)
        result = run_tool(
            tool,
            call,
            timeout_s=timeout,
            max_result_chars=self.max_result_chars,
            known_tools=tuple(self.tools),
        )
        return EnvStep(
            self.format.render_result(result),
            done=False,
            tool_calls=1,
            tool_errors=int(bool(result.error)),  # a result cut at max_result_chars too
            error=result.error,
        )

    def tools_schema(self) -> list[dict[str, Any]]:
        """The tools as OpenAI-style function specs, for a chat template's `tools=`."""
        return [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": copy.deepcopy(t.parameters),
                },
            }
            for t in self.tools.values()
        ]
