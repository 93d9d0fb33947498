"""Environments a model acts in over several turns, and the tool-calling one.

The worker makes one environment per trajectory: `reset(record)` gives the first
observation (the prompt the model sees), then each model turn goes to `step`, whose
`EnvStep` holds the next observation (an environment turn the model reads) or ends the
trajectory. Steps of different trajectories may run at once in a thread pool, so an
environment keeps no state shared with others (tools are stateless, or thread-safe like
the shared sandbox).

An environment may judge whether a trajectory used its tools correctly
(`EnvStep.tool_correct`); the calculator does (`tool_result_is_answer`), the generic
`tools` and `python` environments cannot tell (None).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

from rlax_data.datasets import Record
from rlax_data.envs.formats import MalformedCall, ParsedCall, ToolFormat
from rlax_data.envs.tools import Tool, ToolCall, ToolResult, run_tools

__all__ = [
    "TOOL_MESSAGE_SEPARATOR",
    "EnvStep",
    "Environment",
    "ToolEnvironment",
    "ToolUseJudge",
    "final_answer_line",
    "tool_result_is_answer",
]

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

    tool_correct: whether the trajectory's tool use, as of this step, was correct: True
    only when a call's result was right and that result was used (the calculator: a call
    returned the record's answer and the final answer is that result), False otherwise (a
    trajectory that has not answered yet, or made no call, has not used a tool correctly);
    None when the environment cannot tell. The worker keeps the last step's value that is
    not None (`rlax_protocol.Sample.tool_correct`), so the step that ends the trajectory
    gives the verdict, and one cut short keeps the verdict of its last step.
    """

    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    error: str = ""
    tool_correct: bool | None = None


class ToolUseJudge(Protocol):
    """Whether a trajectory of `ToolEnvironment` used its tools correctly (None: cannot tell).

    record: the trajectory's record; results: the results of every call run so far, in
    order; final_turn: the model turn without a call that ended the trajectory (its text),
    None while it has not ended."""

    def __call__(
        self, record: Record, results: Sequence[ToolResult], final_turn: str | None
    ) -> bool | None: ...


def final_answer_line(turn: str) -> str:
    """The final answer of a model turn as the exact-match verifiers read it
    (`ExactMatchConfig(extract="first_line")`): its first non-empty line, stripped."""
    return next((line.strip() for line in turn.splitlines() if line.strip()), "")


def tool_result_is_answer(
    record: Record, results: Sequence[ToolResult], final_turn: str | None
) -> bool | None:
    """The calculator's judge: correct when a call's result is the value the record asks
    for (the model asked the right question; a call that failed or was cut counts for
    nothing) and the final answer (`final_answer_line`) is the record's answer (the model
    used that result). So a right call whose result is copied wrong is not correct, nor is
    a wrong call whose result is copied; no call is not correct.

    The value is the record's `metadata["value"]` where it has one (tool_arithmetic's chat
    style, whose answer is a sentence around the number), else its answer. None for a
    record without an answer."""
    if record.answer is None:
        return None
    value = str(record.metadata.get("value", record.answer)).strip()
    asked_right = any(r.ok and not r.error and r.text.strip() == value for r in results)
    return asked_right and final_turn is not None and final_answer_line(final_turn) == record.answer.strip()


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
    template). judge: says whether a trajectory used its tools correctly
    (`EnvStep.tool_correct`; None: the environment does not judge, every step says None).

    Without a judge a step depends on its turn alone (`independent_steps`): an
    environment run in the verifier service (`rlax_data.envs.remote`) is not replayed up to
    the turn it answers. A judge reads the results of earlier turns' calls, so with one the
    service replays the earlier turns (their calls run again; the calculator's cost
    microseconds).
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        format: ToolFormat,
        *,
        max_result_chars: int = 4096,
        tool_timeout_s: float | None = None,
        instructions: str = "",
        name: str = "tools",
        judge: ToolUseJudge | None = None,
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
        self.judge = judge
        self.independent_steps = judge is None
        self._done = False
        self._record: Record | None = None
        self._results: list[ToolResult] = []  # of the calls that ran, for the judge

    def reset(self, record: Record) -> str:
        self._done = False
        self._record = record
        self._results = []
        return self.instructions + record.prompt_text()

    def _judged(self, final_turn: str | None) -> bool | None:
        if self.judge is None or self._record is None:
            return None
        verdict = self.judge(self._record, tuple(self._results), final_turn)
        return None if verdict is None else bool(verdict)

    def step(self, model_turn: str) -> EnvStep:
        if self._done:
            raise RuntimeError(f"environment {self.name!r}: step after the trajectory ended; reset it first")
        parsed = self.format.parse(model_turn)
        if not parsed:
            self._done = True
            return EnvStep("", done=True, tool_correct=self._judged(model_turn))
        limit = self.format.max_calls
        answered, refused = self._answer(parsed[:limit]), parsed[limit:]
        self._results += answered
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
            tool_correct=self._judged(None),
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
