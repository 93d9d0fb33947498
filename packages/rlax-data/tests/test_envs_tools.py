"""Tools: the calculator computes what Python computes and refuses everything else at
once; `run_tool` contains whatever a tool does (raise, exit, hang, flood, huge output);
the Python tool runs programs in the sandbox and reports every way they end."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import threading

import pytest

from rlax_core.testing import wait_until
from rlax_data.envs import (
    TOOL_ERROR_KINDS,
    CalculatorTool,
    PythonTool,
    Tool,
    ToolCall,
    ToolError,
    ToolResult,
    ToolThreads,
    run_tool,
)
from rlax_data.verify import ExecJob, Sandbox, SandboxConfig


def calc(expression: str) -> ToolResult:
    # A generous limit: a calculator that hangs shows up as "timeout", never as a pass.
    return run_tool(CalculatorTool(), ToolCall("calculator", {"expression": expression}), timeout_s=5.0,
                    max_result_chars=4096)  # fmt: skip


class FakeTool:
    """A tool whose behaviour is a function of the test's choosing."""

    description = "test tool"
    parameters = {"type": "object", "properties": {"x": {"type": "string"}}}
    time_limit_s = 1.0

    def __init__(self, behaviour, name: str = "fake") -> None:
        self.behaviour = behaviour
        self.name = name

    def __call__(self, arguments):
        return self.behaviour(arguments)


def run_fake(behaviour, *, timeout_s: float = 2.0, max_result_chars: int = 100, threads=None) -> ToolResult:
    return run_tool(FakeTool(behaviour), ToolCall("fake", {"x": "1"}), timeout_s=timeout_s,
                    max_result_chars=max_result_chars, threads=threads)  # fmt: skip


# -- calculator ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("4821*397", "1913937"),
        ("2**10", "1024"),
        ("7/2", "3.5"),
        ("-7//2", "-4"),
        ("7%-3", "-2"),
        ("(1+2)*3", "9"),
        ("  -(+3) - -4 ", "1"),
        ("0.1+0.2", "0.30000000000000004"),
        ("10**20", "100000000000000000000"),
        ("1e3", "1000.0"),
        ("2**-1", "0.5"),
        ("6/3", "2.0"),
        ("1_000*3", "3000"),
        ("0x10+1", "17"),
        ("2.5e-3*4", "0.01"),
    ],
)
def test_calculator_hand_worked_values(expression, expected):
    assert calc(expression) == ToolResult(text=expected, ok=True)


def _random_expression(rng: random.Random, depth: int) -> str:
    if depth == 0 or rng.random() < 0.3:
        number = str(rng.randint(0, 10 ** rng.randint(1, 6)))
        return number if rng.random() < 0.8 else f"{number}.{rng.randint(0, 99)}"
    if rng.random() < 0.15:
        return f"-({_random_expression(rng, depth - 1)})"
    op = rng.choice(["+", "-", "*", "/", "//", "%", "**"])
    left = _random_expression(rng, depth - 1)
    right = str(rng.randint(0, 4)) if op == "**" else _random_expression(rng, depth - 1)
    return f"({left}){op}({right})"


def test_calculator_matches_python_on_random_expressions():
    rng = random.Random(1234)
    checked = errors = 0
    for _ in range(500):
        expression = _random_expression(rng, 3)
        try:
            value = eval(expression, {"__builtins__": {}})  # the reference: Python itself
        except (ZeroDivisionError, OverflowError):
            value = None
        got = calc(expression)
        if value is None or isinstance(value, complex) or (isinstance(value, int) and abs(value) >= 10**1000):
            assert not got.ok and got.error == "bad_arguments", (expression, got)
            errors += 1
            continue
        if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
            assert not got.ok, (expression, got)
            continue
        want = str(value) if isinstance(value, int) else repr(value)
        assert got == ToolResult(text=want, ok=True), expression
        checked += 1
    assert checked > 300 and errors > 0


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9**9**9**9", "more than 1000 digits"),
        ("10**1000", "more than 1000 digits"),
        ("(10**500)*(10**500)", "more than 1000 digits"),
        ("2**(10**100)", "more than 1000 digits"),
        ("(-3)**99999999999", "more than 1000 digits"),
        ("__import__('os')", "a function call is not allowed"),
        ("().__class__", "attribute access is not allowed"),
        ("(1, 2)", "a tuple is not allowed"),
        ("(lambda: 1)()", "a function call is not allowed"),
        ("x+1", "the name 'x' is not allowed"),
        ("'a'*10", "only numbers are allowed, not str literals"),
        ("[1]*10", "a list is not allowed"),
        ("1 if 1 else 2", "a conditional expression is not allowed"),
        ("1<2", "a comparison is not allowed"),
        ("1<<5", "the operator << is not allowed"),
        ("~1", "the operator ~ is not allowed"),
        ("1j", "not complex literals"),
        ("True+1", "not bool literals"),
        ("1e400", "too large for a float"),
        ("1e308*10", "too large for a float"),
        ("(10**999)/3", "too large for a float"),
        ("2.0**5000", "too large for a float"),
        ("(-8)**0.5", "not a real number"),
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("5%0.0", "division by zero"),
        ("0**-1", "division by zero"),
        ("1+" * 60 + "1", "more than 100 parts"),
        ("(" * 150 + "1" + ")" * 150, "longer than 200 characters"),
        ("1" * 201, "longer than 200 characters"),
        ("", "empty"),
        ("1+", "not a valid expression"),
        ("1\x002", "not a valid expression"),
        ("x := 1", "not a valid expression"),
        ("(x := 1)", "an assignment is not allowed"),
        ("{1: 2}[1]", "a subscript is not allowed"),
        ("f'{1}'", "an f-string is not allowed"),
        ("1 and 2", "and/or is not allowed"),
        ("[i for i in range(10**9)]", "a comprehension is not allowed"),
    ],
)
def test_calculator_refuses_with_a_reason(expression, message):
    got = calc(expression)
    assert not got.ok and got.error == "bad_arguments", got
    assert got.text.startswith("Error: calculator: ") and message in got.text, got.text


def test_calculator_extremes_just_inside_the_limits():
    assert calc("10**999").text == "1" + "0" * 999
    assert calc("9" * 200).text == "9" * 200
    assert calc("2**3321").text == str(2**3321)
    assert calc("1**(10**500)").text == "1"
    assert calc("-(" * 49 + "1" + ")" * 49).text == "-1"


def test_calculator_argument_checks():
    tool = CalculatorTool()
    assert isinstance(tool, Tool)
    for args, message in [
        ({}, "missing argument(s) 'expression'"),
        ({"expression": 12}, "`expression` must be a string, got int"),
        ({"expression": "1", "code": "x"}, "unknown argument(s) 'code'"),
    ]:
        got = run_tool(tool, ToolCall("calculator", args), timeout_s=5.0, max_result_chars=4096)
        assert (got.ok, got.error) == (False, "bad_arguments") and message in got.text, got.text


# -- run_tool --------------------------------------------------------------------------------


def _raise(error: BaseException):
    def behaviour(arguments):
        raise error

    return behaviour


def test_run_tool_contains_every_failure_of_a_tool():
    got = run_fake(_raise(ValueError("boom")))
    assert (got.ok, got.error, got.text) == (
        False,
        "crash",
        "Error: the tool 'fake' failed: ValueError: boom",
    )
    got = run_fake(_raise(ToolError("x must be a number")))
    assert (got.ok, got.error, got.text) == (False, "bad_arguments", "Error: x must be a number")
    got = run_fake(_raise(ToolError("it broke", kind="crash")))
    assert (got.error, got.text) == ("crash", "Error: it broke")
    got = run_fake(lambda a: sys.exit(3))
    assert (got.ok, got.error, got.text) == (False, "crash", "Error: the tool 'fake' failed: SystemExit: 3")
    got = run_fake(_raise(KeyboardInterrupt()))
    assert (got.ok, got.error, got.text) == (
        False,
        "crash",
        "Error: the tool 'fake' failed: KeyboardInterrupt",
    )
    got = run_fake(_raise(RecursionError("deep")))
    assert got.error == "crash" and "RecursionError: deep" in got.text
    got = run_fake(lambda a: 42)
    assert (got.ok, got.error, got.text) == (False, "crash", "Error: the tool 'fake' returned int, not text")
    got = run_fake(lambda a: None)
    assert got.error == "crash" and "returned NoneType" in got.text

    class Hostile(Exception):
        def __str__(self):
            raise RuntimeError("no")

    got = run_fake(_raise(Hostile()))
    assert got.error == "crash" and "Hostile: <unprintable>" in got.text


def test_run_tool_returns_plain_str_for_a_str_subclass():
    class Sneaky(str):
        def __len__(self):
            return 0

    got = run_fake(lambda a: Sneaky("abc"))
    assert got == ToolResult(text="abc", ok=True) and type(got.text) is str


def test_a_huge_result_is_cut_and_counted_as_too_large():
    got = run_fake(lambda a: "x" * 10_000_000, max_result_chars=100)
    assert got.ok and got.error == "too_large"
    assert got.text == "x" * 100 + "\n[truncated: 9999900 more characters]"
    error = run_fake(_raise(ValueError("y" * 10_000)), max_result_chars=50)
    assert (error.ok, error.error) == (False, "crash") and len(error.text) < 100
    exact = run_fake(lambda a: "z" * 100, max_result_chars=100)
    assert exact == ToolResult(text="z" * 100, ok=True)


def test_unknown_tool_names_the_known_ones():
    got = run_tool(
        None, ToolCall("nope", {}), timeout_s=1.0, max_result_chars=100, known_tools=("calculator",)
    )
    assert got == ToolResult(
        text="Error: there is no tool named 'nope'; the tools are: calculator", ok=False, error="unknown_tool"
    )
    got = run_tool(None, ToolCall("n" * 10_000, {}), timeout_s=1.0, max_result_chars=4096)
    assert got.error == "unknown_tool" and len(got.text) < 200


def test_bad_arguments_are_checked_against_the_schema_before_the_tool_runs():
    calls = []
    strict = FakeTool(lambda a: calls.append(a) or "ran")
    strict.parameters = {
        "type": "object",
        "properties": {"x": {}},
        "required": ["x"],
        "additionalProperties": False,
    }
    for arguments, message in [
        ({}, "missing argument(s) 'x'"),
        ({"x": 1, "y": 2}, "unknown argument(s) 'y'"),
    ]:
        got = run_tool(strict, ToolCall("fake", arguments), timeout_s=1.0, max_result_chars=100)
        assert got.error == "bad_arguments" and message in got.text
    got = run_tool(strict, ToolCall("fake", [1, 2]), timeout_s=1.0, max_result_chars=100)  # type: ignore[arg-type]
    assert got.error == "bad_arguments" and "must be an object, got list" in got.text
    assert calls == []


def test_a_hung_tool_times_out_and_its_thread_is_abandoned():
    import time

    threads = ToolThreads(max_threads=2)
    got = run_fake(lambda a: time.sleep(1000), timeout_s=0.2, threads=threads)
    assert got == ToolResult(
        text="Error: the tool 'fake' did not finish within 0.2 s", ok=False, error="timeout"
    )
    stuck = [t for t in threading.enumerate() if t.name == "rlax-tool"]
    assert stuck and all(t.daemon for t in stuck)


def test_hung_tools_give_back_their_slots_and_abandoned_threads_are_bounded():
    # Issue 29: a hung call used to keep its slot until the tool returned, so after
    # max_threads hung calls (64 by default) even the calculator timed out.
    release = threading.Event()
    threads = ToolThreads(max_threads=2, max_abandoned=21)
    try:
        before = threading.active_count()
        for _ in range(20):
            got = run_fake(lambda a: release.wait(60) and "late", timeout_s=0.05, threads=threads)
            assert got.error == "timeout" and "did not finish within 0.05 s" in got.text
        assert threads.abandoned == 20
        # Capacity never shrank: a quick call still runs at once.
        assert run_tool(CalculatorTool(), ToolCall("calculator", {"expression": "6*7"}), timeout_s=5.0,
                        max_result_chars=100, threads=threads) == ToolResult(text="42", ok=True)  # fmt: skip
        # But the hung threads are bounded: past max_abandoned, calls are refused at once
        # (a counted timeout) and no thread is made for them.
        assert (
            run_fake(lambda a: release.wait(60) and "late", timeout_s=0.05, threads=threads).error
            == "timeout"
        )
        assert threads.abandoned == 21
        got = run_fake(lambda a: "never runs", timeout_s=5.0, threads=threads)
        assert got.error == "timeout" and "too many earlier tool calls hung" in got.text
        assert threading.active_count() <= before + 21
    finally:
        release.set()
    # Once the hung calls return, their threads end and calls run again.
    wait_until(lambda: threads.abandoned == 0)
    assert run_fake(lambda a: "ok", timeout_s=5.0, threads=threads) == ToolResult(text="ok", ok=True)


def test_seventy_hung_calls_do_not_stop_the_calculator_of_a_tool_environment():
    """The process-wide launcher (64 threads) after more hung calls than it has threads."""
    from rlax_data.envs import HermesToolFormat, ToolEnvironment
    from rlax_data.envs.tools import _THREADS

    release = threading.Event()
    hang = FakeTool(lambda a: release.wait(60) and "late", name="hang")
    fmt = HermesToolFormat()
    env = ToolEnvironment([hang, CalculatorTool()], fmt, tool_timeout_s=0.05)
    try:
        for _ in range(_THREADS.max_threads + 6):
            step = env.step(fmt.render_call(ToolCall("hang", {"x": "1"})))
            assert (step.error, step.tool_errors) == ("timeout", 1)
        step = env.step(fmt.render_call(ToolCall("calculator", {"expression": "6*7"})))
        assert (step.observation, step.error, step.tool_errors) == (
            "42",
            "",
            0,
        )
    finally:
        release.set()


def test_a_busy_looping_tool_is_interrupted_after_its_deadline():
    threads = ToolThreads(max_threads=1)
    stopped = threading.Event()

    def spin(arguments):
        try:
            while True:
                pass
        finally:
            stopped.set()

    assert run_fake(spin, timeout_s=0.05, threads=threads).error == "timeout"
    # The abandoned thread got WorkAbandoned and ended: it no longer competes for the GIL.
    assert stopped.wait(30)
    assert run_fake(lambda a: "ok", timeout_s=5.0, threads=threads) == ToolResult(text="ok", ok=True)


def test_a_hung_tool_does_not_hold_up_the_process_exit():
    script = textwrap.dedent(
        """
        import time
        from rlax_data.envs import ToolCall, run_tool

        class Hang:
            name, description, parameters, time_limit_s = "hang", "", {}, 1.0
            def __call__(self, arguments):
                time.sleep(1000)

        print(run_tool(Hang(), ToolCall("hang", {}), timeout_s=0.2, max_result_chars=100).error)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "timeout", out.stderr


def test_a_host_out_of_threads_is_a_crash_result(monkeypatch):
    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    threads = ToolThreads(max_threads=1)
    got = run_fake(lambda a: "x", threads=threads)
    assert got == ToolResult(text="Error: the tool 'fake' could not start: no thread available", ok=False,
                             error="crash")  # fmt: skip
    monkeypatch.undo()
    assert run_fake(lambda a: "x", threads=threads) == ToolResult(text="x", ok=True)  # the slot came back


def test_tool_result_and_error_reject_unknown_kinds():
    with pytest.raises(ValueError, match="needs an error kind"):
        ToolResult(text="x", ok=False)
    with pytest.raises(ValueError, match="'oops' is not one of"):
        ToolResult(text="x", ok=False, error="oops")
    with pytest.raises(ValueError, match="an ok result cannot have error 'crash'"):
        ToolResult(text="x", ok=True, error="crash")
    with pytest.raises(ValueError, match="kind: 'oops'"):
        ToolError("x", kind="oops")
    assert set(TOOL_ERROR_KINDS) == {
        "malformed",
        "unknown_tool",
        "bad_arguments",
        "crash",
        "timeout",
        "too_large",
        "too_many_calls",
    }
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_fake(lambda a: "x", timeout_s=0)


# -- the Python tool -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def python_tool() -> PythonTool:
    # A wall-clock limit well above the CPU limit, so that a busy loop meets the CPU limit
    # first even on a loaded machine.
    config = SandboxConfig(
        timeout_s=5.0, cpu_s=1, memory_mb=256, file_size_mb=1, max_procs=4, tmpfs_mb=8, workers=1
    )
    return PythonTool(config)


def py(tool: PythonTool, code: str, max_result_chars: int = 4096) -> ToolResult:
    return run_tool(tool, ToolCall("python", {"code": code}), timeout_s=tool.time_limit_s,
                    max_result_chars=max_result_chars)  # fmt: skip


def test_python_tool_returns_what_the_program_printed(python_tool):
    assert isinstance(python_tool, Tool)
    assert py(python_tool, "print(6 * 7)\nprint('done')") == ToolResult(text="42\ndone", ok=True)
    assert py(python_tool, "import sys\nprint('to stderr', file=sys.stderr)") == ToolResult(
        text="to stderr", ok=True
    )
    assert py(python_tool, "import sys\nprint('bye')\nsys.exit(0)") == ToolResult(text="bye", ok=True)
    assert py(python_tool, "x = 1") == ToolResult(text="", ok=True)


def test_python_tool_shows_the_programs_traceback_without_the_runner(python_tool):
    got = py(python_tool, "print('before')\n1/0")
    assert (got.ok, got.error) == (False, "crash")
    assert got.text == (
        "Error: the program failed (exit status 1: ZeroDivisionError: division by zero)\n"
        "before\n"
        "Traceback (most recent call last):\n"
        '  File "<program>", line 2, in <module>\n'
        "ZeroDivisionError: division by zero"
    )
    got = py(python_tool, "import sys\nsys.exit(3)")
    assert (got.error, got.text) == ("crash", "Error: the program failed (exit status 3: )")


@pytest.mark.parametrize(
    ("code", "kind", "message"),
    [
        ("while True:\n    pass", "timeout", "was stopped after 1 s of CPU time"),
        ("import os\nfor _ in range(100):\n    os.fork()", "crash", "process limit 4"),
        ("x = bytearray(10 * 2**30)", "crash", "MemoryError (memory limit 256 MB)"),
        ("print(open('/etc/passwd').read())", "crash", "No such file or directory: '/etc/passwd'"),
        (
            "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)",
            "crash",
            "Network is unreachable",
        ),
        ("import os\nos.kill(os.getpid(), 9)", "crash", "SIGKILL"),
    ],
)
def test_python_tool_contains_hostile_programs(python_tool, code, kind, message):
    got = py(python_tool, code)
    assert (got.ok, got.error) == (False, kind), got
    assert message in got.text, got.text


def test_python_tool_stops_a_sleeping_program_at_the_wall_clock_limit():
    tool = PythonTool(SandboxConfig(timeout_s=1.0, cpu_s=5, memory_mb=256, file_size_mb=1, workers=1))
    got = py(tool, "import time\nprint('started', flush=True)\ntime.sleep(100)")
    assert got == ToolResult(
        text="Error: the program was stopped after 1 s\nstarted", ok=False, error="timeout"
    )


def test_python_tool_output_limits(python_tool):
    # 10 MB printed: the sandbox stops the program at its 1 MB file-size limit.
    got = py(python_tool, "print('x' * 10_000_000)", max_result_chars=200)
    assert (got.ok, got.error) == (False, "too_large")
    assert got.text.startswith(
        "Error: the program was stopped: it wrote more than 1 MB (output or files)\nxxxx"
    )
    assert got.text.endswith("more characters]") and len(got.text) < 300
    # Within the sandbox's limit but over the caller's: cut, and still a result.
    got = py(python_tool, "print('y' * 50_000)", max_result_chars=100)
    assert (got.ok, got.error) == (True, "too_large")
    assert got.text == "y" * 100 + "\n[truncated: 49900 more characters]"


def test_python_tool_refuses_bad_arguments(python_tool):
    got = run_tool(python_tool, ToolCall("python", {"code": 5}), timeout_s=10.0, max_result_chars=100)
    assert got.error == "bad_arguments" and "`code` must be a string, got int" in got.text
    got = py(python_tool, "#" * 20_001)
    assert got.error == "bad_arguments" and "longer than 20000 characters" in got.text


def test_run_jobs_report_status_and_output_without_cases(sandbox: Sandbox):
    ok, crashed = sandbox.run(
        [
            ExecJob(mode="run", program="print(input()[::-1])", stdin="abc\n"),
            ExecJob(mode="run", program="1/0"),
        ]
    )
    assert (ok.status, ok.cases, ok.stdout, ok.returncode) == ("ok", [], "cba\n", 0)
    assert crashed.status == "crashed" and crashed.cases == [] and "ZeroDivisionError" in crashed.reason
