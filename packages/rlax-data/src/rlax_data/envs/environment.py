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
from typing import Any, Final, Protocol, runtime_checkable

from rlax_data.datasets import Record
from rlax_data.envs.formats import MalformedCall, ParsedCall, ToolFormat
from rlax_data.envs.tools import Tool, ToolCall, ToolResult, run_tools

__all__ = ["TOOL_MESSAGE_SEPARATOR", "EnvStep", "Environment", "ToolEnvironment"]

TOOL_MESSAGE_SEPARATOR: Final = "\x1e"
"""Separates the messages of one environment turn (the results of a turn's calls, one
message each): the turn codec (`rlax_data.agent_turns`) wraps each as the chat template
wraps a tool message. ASCII's record separator; it never reaches the tokenizer, and a
tool's own output cannot hold it (`ToolEnvironment` replaces it there)."""


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn.

    observation: the next environment turn ("" when done); the messages of a turn with
    several calls are joined by `TOOL_MESSAGE_SEPARATOR`. reward: None lets the run's
    verifier score the final answer. tool_calls / tool_errors: calls made / failed in this
    step, one count per call (every result with an error kind is a failed call, a
    truncated one included; a malformed call is failed but not made). error: the
    `ToolResult.error` kind of this step's first failed call ("" when none failed), so the
    metrics count each kind.
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
    verifier scores the answer); otherwise the turn's calls run at once through
    `run_tools`, each under its own time limit (a step takes as long as its slowest call,
    not their sum), and the next observation shows their rendered results in call order,
    one message each. A malformed call is answered with an error result in its place and
    the well-formed calls around it still run: what the model would get from making them
    in separate turns. Calls beyond the format's `max_calls` are not run; one error result
    after the others names the limit. The trajectory goes on after any error; the number
    of turns is the caller's to bound.

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
        parsed = self.format.parse(model_turn)
        if not parsed:
            self._done = True
            return EnvStep("", done=True)
        limit = self.format.max_calls
        answered, refused = self._answer(parsed[:limit]), parsed[limit:]
        results = list(answered)
        if refused:
            text = (
                f"Error: a turn may make at most {limit} tool call(s); "
                f"the {len(refused)} after the first {limit} were not run"
            )
            results.append(ToolResult(text=text, ok=False, error="too_many_calls"))
        failed = [r.error for r in results if r.error]
        return EnvStep(
            TOOL_MESSAGE_SEPARATOR.join(self._render(r) for r in results),
            done=False,
            tool_calls=sum(isinstance(p, ToolCall) for p in parsed),
            # A result cut at max_result_chars counts as failed too; each refused call does.
            tool_errors=sum(bool(r.error) for r in answered) + len(refused),
            error=failed[0] if failed else "",
        )

    def _answer(self, parsed: Sequence[ParsedCall]) -> list[ToolResult]:
        """The result of each of `parsed`, in order; the well-formed calls run at once."""
        results: list[ToolResult | None] = [None] * len(parsed)
        jobs: list[tuple[Tool | None, ToolCall, float]] = []
        places: list[int] = []
        for i, item in enumerate(parsed):
            if isinstance(item, MalformedCall):
                results[i] = ToolResult(
                    text=f"Error: malformed tool call: {item.reason}", ok=False, error="malformed"
                )
                continue
            tool = self.tools.get(item.name)
            timeout = self.tool_timeout_s or (tool.time_limit_s if tool is not None else 1.0)
            jobs.append((tool, item, timeout))
            places.append(i)
        ran = run_tools(jobs, max_result_chars=self.max_result_chars, known_tools=tuple(self.tools))
        for i, result in zip(places, ran, strict=True):
            results[i] = result
        return [r for r in results if r is not None]

    def _render(self, result: ToolResult) -> str:
        # The separator splits messages: a tool's output must not be able to cut its own.
        return self.format.render_result(result).replace(TOOL_MESSAGE_SEPARATOR, "\ufffd")

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
