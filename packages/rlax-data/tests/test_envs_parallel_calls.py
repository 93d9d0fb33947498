"""Several tool calls in one model turn, in every format that holds several: they run at
once (shown with tools that meet at a barrier, not with timings), their results come back
in call order, one message each; a malformed call is an error result in its place while
the others run; calls beyond the limit are refused with one result naming it."""

from __future__ import annotations

import json
import threading

import msgspec
import pytest

import rlax_protocol as rp
from rlax_data import Record
from rlax_data.envs import (
    TOOL_MESSAGE_SEPARATOR,
    CalculatorTool,
    EnvStep,
    ToolCall,
    ToolEnvironment,
    ToolResult,
    make_tool_format,
    run_tools,
)
from rlax_data.envs.remote import EnvOptions, EnvStepServer

RECORD = Record(id="r0", prompt="4821*397=", answer="1913937")
SEVERAL = ("hermes", "llama3_json", "mistral")


def turn_of(format_name: str, calls: list[str]) -> str:
    """A model turn holding `calls` (JSON texts, well formed or not), written by hand in
    the format's syntax rather than by the format under test."""
    if format_name == "hermes":
        return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)
    if format_name == "llama3_json":
        return "; ".join(calls)
    assert format_name == "mistral"
    return "[TOOL_CALLS][" + ", ".join(calls) + "]"


def call(name: str, **arguments) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def messages(step: EnvStep) -> list[str]:
    return step.observation.split(TOOL_MESSAGE_SEPARATOR)


class Rendezvous:
    """Every call waits at a barrier that opens only when `parties` calls wait at once (so
    calls made one after another fail it), then, when told to, until another call has
    finished: the calls finish in an order the test picks."""

    name = "meet"
    description = "meets the other calls"
    parameters = {"type": "object", "properties": {"id": {"type": "string"}, "after": {"type": "string"}}}
    time_limit_s = 60.0

    def __init__(self, parties: int) -> None:
        self.barrier = threading.Barrier(parties, timeout=30)
        self.done = {k: threading.Event() for k in "abcdefgh"}
        self.finished: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, arguments):
        self.barrier.wait()  # BrokenBarrierError (a crash result) unless all run at once
        after = arguments.get("after")
        if after and not self.done[after].wait(30):
            raise RuntimeError(f"{after} never finished")
        with self.lock:
            self.finished.append(arguments["id"])
        self.done[arguments["id"]].set()
        return f"result {arguments['id']}"


class Counter:
    name = "count"
    description = "counts its calls"
    parameters = {"type": "object", "properties": {}}
    time_limit_s = 5.0

    def __init__(self) -> None:
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, arguments):
        with self.lock:
            self.calls += 1
        return "counted"


class Hang:
    name = "hang"
    description = "waits until released"
    parameters = {"type": "object", "properties": {}}
    time_limit_s = 0.2

    def __init__(self) -> None:
        self.release = threading.Event()

    def __call__(self, arguments):
        self.release.wait(60)
        return "late"


def environment(format_name: str, tools, max_calls: int, **options) -> ToolEnvironment:
    env = ToolEnvironment(tools, make_tool_format(format_name, max_calls=max_calls), **options)
    env.reset(RECORD)
    return env


@pytest.mark.parametrize("format_name", SEVERAL)
def test_a_turns_calls_run_at_once_and_their_results_come_back_in_call_order(format_name):
    meet = Rendezvous(parties=3)
    env = environment(format_name, [meet], max_calls=3)
    # a waits for c, b for a: they finish c, a, b, and are shown a, b, c.
    turn = turn_of(
        format_name, [call("meet", id="a", after="c"), call("meet", id="b", after="a"), call("meet", id="c")]
    )
    step = env.step(turn)
    assert meet.finished == ["c", "a", "b"]
    fmt = env.format
    assert messages(step) == [fmt.render_result(ToolResult(text=f"result {k}", ok=True)) for k in "abc"]
    assert (step.done, step.tool_calls, step.tool_errors, step.error) == (False, 3, 0, "")


@pytest.mark.parametrize("format_name", SEVERAL)
def test_one_call_per_turn_still_works_in_every_format(format_name):
    env = environment(format_name, [CalculatorTool()], max_calls=1)
    step = env.step(turn_of(format_name, [call("calculator", expression="4821*397")]))
    assert messages(step) == [env.format.render_result(ToolResult(text="1913937", ok=True))]
    assert (step.tool_calls, step.tool_errors) == (1, 0)
    assert env.step("The answer is 1913937.") == EnvStep("", done=True)


DEEP = '{"name": "calculator", "arguments": {"x": ' + "[" * 40 + "]" * 40 + "}}"
HUGE = call("calculator", expression="1+" * 40_000 + "1")
MALFORMED = {
    # Balanced brackets: in Llama's and Mistral's one-line lists an unclosed bracket would
    # swallow the calls after it (test_envs_formats_llama_mistral.py shows that case).
    "bad JSON": ('{"name": "calculator" "arguments": {}}', "malformed", "not valid JSON"),
    "missing name": ('{"arguments": {"expression": "1+1"}}', "malformed", "name must be a non-empty string"),
    "unknown tool": (call("search", query="x"), "unknown_tool", "there is no tool named 'search'"),
    "oversized payload": (HUGE, "malformed", "longer than 65536 characters"),
    "deep nesting": (DEEP, "malformed", "nested deeper than 32 levels"),
    "bad arguments": (call("calculator", expression="1/0"), "bad_arguments", "division by zero"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("format_name", SEVERAL)
def test_a_faulty_call_is_an_error_result_in_its_place_and_the_others_run(format_name, case):
    text, kind, message = MALFORMED[case]
    counter = Counter()
    # The calculator's own 1 s limit: under a loaded suite it was once missed (a timeout, not the error).
    env = environment(format_name, [CalculatorTool(), counter], max_calls=3, tool_timeout_s=30.0)
    step = env.step(turn_of(format_name, [call("calculator", expression="6*7"), text, call("count")]))
    render = env.format.render_result
    first, middle, last = messages(step)
    assert (first, last) == (
        render(ToolResult(text="42", ok=True)),
        render(ToolResult(text="counted", ok=True)),
    )
    assert message in middle and "Error: " in middle
    assert counter.calls == 1
    made = 3 if kind != "malformed" else 2  # a malformed call is failed but not made
    assert (step.done, step.tool_calls, step.tool_errors, step.error) == (False, made, 1, kind)


@pytest.mark.parametrize("format_name", SEVERAL)
def test_calls_beyond_the_limit_are_refused_with_one_result_naming_it(format_name):
    counter = Counter()
    env = environment(format_name, [counter], max_calls=2)
    step = env.step(turn_of(format_name, [call("count")] * 4 + ["{garbled"]))
    counted = env.format.render_result(ToolResult(text="counted", ok=True))
    refusal = env.format.render_result(
        ToolResult(
            text="Error: a turn may make at most 2 tool call(s); the 3 after the first 2 were not run",
            ok=False,
            error="too_many_calls",
        )
    )
    assert messages(step) == [counted, counted, refusal]
    assert counter.calls == 2
    # Every call counts: 4 made (the garbled one is not a call), 3 failed (refused).
    assert (step.tool_calls, step.tool_errors, step.error) == (4, 3, "too_many_calls")


def test_the_first_failure_names_the_steps_error_kind():
    env = environment("hermes", [CalculatorTool()], max_calls=3)
    step = env.step(turn_of("hermes", [call("calculator", expression="1"), call("nope"), "{"]))
    assert (step.tool_calls, step.tool_errors, step.error) == (2, 2, "unknown_tool")


@pytest.mark.parametrize("format_name", SEVERAL)
def test_each_call_has_its_own_time_limit(format_name):
    hang = Hang()
    env = environment(format_name, [hang, CalculatorTool()], max_calls=3)
    try:
        step = env.step(
            turn_of(
                format_name,
                [call("calculator", expression="1+1"), call("hang"), call("calculator", expression="2+2")],
            )
        )
        first, middle, last = messages(step)
        render = env.format.render_result
        assert (first, last) == (render(ToolResult(text="2", ok=True)), render(ToolResult(text="4", ok=True)))
        assert "did not finish within 0.2 s" in middle
        assert (step.tool_calls, step.tool_errors, step.error) == (3, 1, "timeout")
    finally:
        hang.release.set()


def test_a_tool_cannot_split_its_own_result_into_messages():
    class Splitter:
        name = "split"
        description = "prints the separator"
        parameters = {"type": "object", "properties": {}}
        time_limit_s = 5.0

        def __call__(self, arguments):
            return f"a{TOOL_MESSAGE_SEPARATOR}b"

    env = environment("llama3_json", [Splitter()], max_calls=2)
    step = env.step(turn_of("llama3_json", [call("split"), call("split")]))
    assert messages(step) == ["a\ufffdb", "a\ufffdb"]


def test_run_tools_keeps_the_order_of_its_jobs():
    meet = Rendezvous(parties=2)
    jobs = [
        (meet, ToolCall("meet", {"id": "a", "after": "b"}), 60.0),
        (None, ToolCall("nowhere", {}), 1.0),
        (meet, ToolCall("meet", {"id": "b"}), 60.0),
    ]
    results = run_tools(jobs, max_result_chars=100, known_tools=("meet",))
    assert [r.text for r in results] == [
        "result a",
        "Error: there is no tool named 'nowhere'; the tools are: meet",
        "result b",
    ]
    assert meet.finished == ["b", "a"]
    assert run_tools([], max_result_chars=100) == []
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_tools([(meet, ToolCall("meet", {}), 0.0)], max_result_chars=100)


def test_the_verifier_service_makes_the_format_with_the_runs_calls_per_turn():
    server = EnvStepServer(threads=2)
    record = msgspec.json.encode(RECORD).decode()
    turn = turn_of("mistral", [call("calculator", expression="6*7"), call("calculator", expression="1+1")])

    def ask(max_calls: int) -> rp.EnvStepResult | rp.RemoteError:
        options = msgspec.json.encode(EnvOptions(format="mistral", max_calls_per_turn=max_calls)).decode()
        request = rp.EnvStepRequest(
            request_id="r",
            environment="calculator",
            record=record,
            turns=(turn,),
            options=options,
            timeout_s=10.0,
        )
        return server.answer(request, server.submit(request), 10.0)

    try:
        both = ask(2)
        assert isinstance(both, rp.EnvStepResult)
        assert both.observation.split(TOOL_MESSAGE_SEPARATOR) == ["42", "2"]
        one = ask(1)
        assert isinstance(one, rp.EnvStepResult) and one.error == "too_many_calls"
    finally:
        server.close()
    for bad in (0, 65):
        with pytest.raises(ValueError, match=r"max_calls_per_turn=.*must be in \[1, 64\]"):
            EnvOptions(max_calls_per_turn=bad)
