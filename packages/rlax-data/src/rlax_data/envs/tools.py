"""Tools a model may call during a trajectory, and `run_tool`, which never lets one fail
the caller.

A tool is plain Python (`Tool`): it takes the call's JSON arguments and returns text, or
raises `ToolError` for input it cannot use. `run_tool` turns everything a tool or a call
can do (an unknown name, bad arguments, an exception of any kind, `sys.exit`, a
non-string result, a huge result, a hang) into a `ToolResult` the model reads next, with
a machine-readable `error` kind for the metrics.

In-process tools run in a daemon thread each, at most `ToolThreads.max_threads` at once
across the process; `run_tools` runs the calls of one model turn at once, each under its
own time limit. A call that overruns its time limit is answered with a timeout and
abandoned (`rlax_core.deadline_threads`): its slot goes to the next call at once, so hung
tools never shrink how many calls can run, and its thread is interrupted (which ends a
tool that runs Python code; one blocked in a C call ends when that call returns). At most
`ToolThreads.max_abandoned` abandoned threads may live; past that, calls fail at once
with a timeout result until some end. In-process tools should still be bounded by
construction (`CalculatorTool` limits sizes before it computes anything); work that may
not end runs in a subprocess that its own deadline kills (`PythonTool`, in the code
verifier's sandbox). A tool that calls `os._exit` or crashes the interpreter cannot be
contained in-process; the built-in tools do neither.
"""

from __future__ import annotations

import ast
import functools
import math
import operator
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, runtime_checkable

from rlax_core.deadline_threads import DeadlineThreads, NoThread, Overloaded
from rlax_data.verify.sandbox import ExecJob, Sandbox, SandboxConfig

__all__ = [
    "TOOL_ERROR_KINDS",
    "CalculatorTool",
    "PythonTool",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "ToolThreads",
    "evaluate_arithmetic",
    "run_tool",
    "run_tools",
]

# Why a call did not give a plain result:
#   malformed: the model's turn held a call that could not be parsed (set by the format);
#   unknown_tool: no tool of that name; bad_arguments: the tool refused its arguments;
#   crash: the tool raised (or the program it ran for the model failed);
#   timeout: the tool did not finish (or could not start) in time;
#   too_large: the output went over a size limit (see `ToolResult`);
#   too_many_calls: the turn held more calls than a turn may (the format's `max_calls`).
TOOL_ERROR_KINDS: Final = (
    "malformed", "unknown_tool", "bad_arguments", "crash", "timeout", "too_large", "too_many_calls",
)  # fmt: skip


@dataclass(frozen=True)
class ToolCall:
    """One call as the model wrote it: the tool's name and its JSON arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolResult:
    """What the model sees after a call (`text`) and how the call went.

    ok=False: the call failed; `error` is one of `TOOL_ERROR_KINDS` and `text` says why,
    starting "Error: ". ok=True with error="too_large": the tool answered, but its text was
    cut at the caller's `max_result_chars` and ends with a marker; the model still gets a
    usable (partial) result, and the call still counts as a tool error (every result with
    an `error` kind does: `ToolEnvironment`'s `tool_errors`). (A program stopped for
    writing too much is ok=False with error "too_large": it did not finish.)
    """

    text: str
    ok: bool
    error: str = ""

    def __post_init__(self) -> None:
        if self.error and self.error not in TOOL_ERROR_KINDS:
            raise ValueError(f"ToolResult.error: {self.error!r} is not one of {TOOL_ERROR_KINDS}")
        if not self.ok and not self.error:
            raise ValueError("ToolResult.error: a failed result (ok=False) needs an error kind")
        if self.ok and self.error not in ("", "too_large"):
            raise ValueError(f"ToolResult.error: an ok result cannot have error {self.error!r}")


class ToolError(Exception):
    """A tool refuses a call or reports a failure; the message is shown to the model.

    kind: the `ToolResult.error` it becomes ("bad_arguments" unless the tool says else).
    """

    def __init__(self, message: str, *, kind: str = "bad_arguments") -> None:
        if kind not in TOOL_ERROR_KINDS:
            raise ValueError(f"ToolError kind: {kind!r} is not one of {TOOL_ERROR_KINDS}")
        super().__init__(message)
        self.kind = kind


@runtime_checkable
class Tool(Protocol):
    """A callable tool.

    parameters: the JSON schema of the arguments (an object schema), as chat templates
    take it in `tools=`; `run_tool` checks its `required` keys and, with
    `"additionalProperties": false`, rejects other keys before calling. time_limit_s: how
    long one call may take before the caller gives up on it.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    time_limit_s: float

    def __call__(self, arguments: dict[str, Any]) -> str:
        """The result text; raises `ToolError` for arguments it cannot use."""
        ...


# -- running a call ------------------------------------------------------------------------


class ToolThreads:
    """Runs tool calls in daemon threads, at most `max_threads` at once, abandoning a call
    at its deadline (`rlax_core.deadline_threads.DeadlineThreads`).

    Not a `ThreadPoolExecutor`: its worker threads are joined when the interpreter exits,
    so one hung tool would hang the worker's shutdown, and each hung call would keep one
    of its threads for good. Here a call that overruns gives its slot to the next call at
    once; its thread counts as abandoned until it ends, and at most `max_abandoned` of
    those may live (then calls are refused until some end).
    """

    def __init__(self, max_threads: int = 64, *, max_abandoned: int = 256) -> None:
        if max_threads < 1:
            raise ValueError(f"ToolThreads: max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self.max_abandoned = max_abandoned
        self._threads = DeadlineThreads(max_threads, max_abandoned=max_abandoned, name="rlax-tool")

    @property
    def abandoned(self) -> int:
        """Calls that overran and whose threads still run."""
        return self._threads.abandoned

    def run(self, work: Callable[[], ToolResult], timeout_s: float) -> ToolResult | str:
        """`work()`'s result, or "timeout" / "no_slot" when it did not finish / start in
        time, "overloaded" when too many abandoned calls still run, "no_thread" when the
        host would not start a thread, or "lost" when `work` raised (`run_tool`'s work
        catches everything: only if building its result failed)."""
        return self.run_all([(work, timeout_s)])[0]

    def run_all(self, works: Sequence[tuple[Callable[[], ToolResult], float]]) -> list[ToolResult | str]:
        """Each `(work, timeout_s)` started at once (as slots allow), each given its own
        `timeout_s` from now (its wait for a slot included): what `run` gives for each, in
        the order of `works`. The calls overlap, so this takes as long as the slowest, not
        their sum."""
        start = time.monotonic()
        futures = [self._threads.submit(work) for work, _ in works]
        try:
            return [
                self._outcome(future, start + timeout_s - time.monotonic())
                for future, (_, timeout_s) in zip(futures, works, strict=True)
            ]
        except BaseException:  # this thread is interrupted (an environment step abandoned)
            for future in futures:
                self._threads.abandon(future)  # nothing happens to a finished one
            raise

    def _outcome(self, future: Future[ToolResult], wait_s: float) -> ToolResult | str:
        try:
            return future.result(timeout=max(0.0, wait_s))
        except TimeoutError:
            started = self._threads.started_at(future)
            self._threads.abandon(future)
            return "no_slot" if started is None else "timeout"
        except Overloaded:
            return "overloaded"
        except NoThread:
            return "no_thread"
        except Exception:
            return "lost"


_THREADS = ToolThreads()


def run_tool(
    tool: Tool | None,
    call: ToolCall,
    *,
    timeout_s: float,
    max_result_chars: int,
    known_tools: tuple[str, ...] = (),
    threads: ToolThreads | None = None,
) -> ToolResult:
    """Run `call` on `tool` (None: no tool has that name) and never raise for anything the
    tool or the call does.

    The result's text holds at most `max_result_chars` characters of the tool's output,
    then a truncation marker. `known_tools` names the tools in the unknown-tool message.
    `threads`: the bounded thread launcher (the process-wide one by default).
    """
    return run_tools(
        [(tool, call, timeout_s)], max_result_chars=max_result_chars, known_tools=known_tools, threads=threads
    )[0]


def run_tools(
    jobs: Sequence[tuple[Tool | None, ToolCall, float]],
    *,
    max_result_chars: int,
    known_tools: tuple[str, ...] = (),
    threads: ToolThreads | None = None,
) -> list[ToolResult]:
    """`run_tool` for each `(tool, call, timeout_s)` of `jobs`, the calls running at once
    (each in a thread of its own, each under its own time limit): their results in the
    order of `jobs`, however the calls finish."""
    for _, _, timeout_s in jobs:
        if timeout_s <= 0:
            raise ValueError(f"run_tool: timeout_s must be > 0, got {timeout_s}")
    if max_result_chars < 1:
        raise ValueError(f"run_tool: max_result_chars must be >= 1, got {max_result_chars}")
    results: list[ToolResult | None] = [None] * len(jobs)
    started: list[tuple[int, Tool, float]] = []
    works: list[tuple[Callable[[], ToolResult], float]] = []
    for i, (tool, call, timeout_s) in enumerate(jobs):
        if tool is None:
            names = f"; the tools are: {', '.join(known_tools)}" if known_tools else ""
            message = f"there is no tool named {call.name!r:.100}{names}"
            results[i] = _failure("unknown_tool", message, max_result_chars)
            continue
        started.append((i, tool, timeout_s))
        works.append((functools.partial(_call, tool, call, max_result_chars), timeout_s))
    outcomes = (threads or _THREADS).run_all(works) if works else []
    for (i, tool, timeout_s), outcome in zip(started, outcomes, strict=True):
        results[i] = _result_of(outcome, tool, timeout_s, max_result_chars)
    return [r for r in results if r is not None]


def _result_of(outcome: ToolResult | str, tool: Tool, timeout_s: float, max_result_chars: int) -> ToolResult:
    """The `ToolResult` of a call's `ToolThreads` outcome."""
    if outcome == "no_slot":
        return _failure(
            "timeout",
            f"the tool {tool.name!r} could not start within {timeout_s:g} s "
            "(too many tool calls are still running)",
            max_result_chars,
        )
    if outcome == "timeout":
        return _failure(
            "timeout", f"the tool {tool.name!r} did not finish within {timeout_s:g} s", max_result_chars
        )
    if outcome == "overloaded":
        return _failure(
            "timeout",
            f"the tool {tool.name!r} could not start: too many earlier tool calls hung and still run",
            max_result_chars,
        )
    if outcome == "no_thread":
        return _failure(
            "crash", f"the tool {tool.name!r} could not start: no thread available", max_result_chars
        )
    if outcome == "lost":
        return _failure(
            "crash", f"the tool {tool.name!r} failed and its error could not be read", max_result_chars
        )
    assert isinstance(outcome, ToolResult)
    return outcome


def _call(tool: Tool, call: ToolCall, max_chars: int) -> ToolResult:
    """One call, inside the tool's thread: every piece of the tool's code (its exception's
    `__str__` included) runs here, under the deadline."""
    try:
        problem = _argument_problem(tool.parameters, call.arguments)
        if problem:
            return _failure("bad_arguments", f"{tool.name}: {problem}", max_chars)
        value = tool(dict(call.arguments))
        if not isinstance(value, str):
            return _failure(
                "crash", f"the tool {tool.name!r} returned {type(value).__name__}, not text", max_chars
            )
        text = str.__str__(value)  # a plain str, whatever subclass came back
        if len(text) > max_chars:
            return ToolResult(text=_truncate(text, max_chars), ok=True, error="too_large")
        return ToolResult(text=text, ok=True)
    except ToolError as e:
        kind = e.kind if e.kind in TOOL_ERROR_KINDS else "crash"
        return _failure(kind, _describe(e, with_type=False), max_chars)
    except BaseException as e:  # noqa: B036 - SystemExit and the rest must not leave the thread
        return _failure("crash", f"the tool {tool.name!r} failed: {_describe(e, with_type=True)}", max_chars)


def _argument_problem(schema: dict[str, Any], arguments: Any) -> str:
    if type(arguments) is not dict:
        return f"arguments must be an object, got {type(arguments).__name__}"
    missing = [k for k in schema.get("required", ()) if k not in arguments]
    if missing:
        return f"missing argument(s) {', '.join(map(repr, missing))}"
    if schema.get("additionalProperties") is False:
        allowed = schema.get("properties", {})
        extra = [k for k in arguments if k not in allowed]
        if extra:
            return f"unknown argument(s) {', '.join(repr(k)[:50] for k in extra[:5])}; it takes {sorted(allowed)}"
    return ""


def _describe(error: BaseException, *, with_type: bool) -> str:
    try:
        message = str(error)
    except BaseException:  # noqa: B036 - a hostile __str__ is the tool's bug, not ours
        message = "<unprintable>"
    name = type(error).__name__
    return (f"{name}: {message}" if message else name) if with_type else message or name


def _failure(kind: str, message: str, max_chars: int) -> ToolResult:
    return ToolResult(text=_truncate("Error: " + message, max_chars), ok=False, error=kind)


def _truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"\n[truncated: {len(text) - max_chars} more characters]"


# -- the calculator ------------------------------------------------------------------------

_MAX_EXPRESSION_CHARS = 200
_MAX_NODES = 100
_MAX_DIGITS = 1000
_INT_LIMIT = 10**_MAX_DIGITS
_BINARY: Final[dict[type[ast.operator], Callable[[Any, Any], Any]]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_OPERATOR_SIGNS: Final = {
    ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
    ast.MatMult: "@", ast.Invert: "~", ast.Not: "not",
}  # fmt: skip
_NODE_WORDS: Final = {
    ast.Call: "a function call", ast.Attribute: "attribute access", ast.Subscript: "a subscript",
    ast.Lambda: "a lambda", ast.Compare: "a comparison", ast.BoolOp: "and/or",
    ast.IfExp: "a conditional expression", ast.List: "a list", ast.Tuple: "a tuple", ast.Dict: "a dict",
    ast.Set: "a set", ast.JoinedStr: "an f-string", ast.NamedExpr: "an assignment",
    ast.ListComp: "a comprehension", ast.GeneratorExp: "a generator", ast.Starred: "a starred expression",
    ast.Await: "await", ast.Yield: "yield",
}  # fmt: skip


class CalculatorTool:
    """Evaluates an arithmetic expression: int and float literals, + - * / // % **, unary
    + and -, parentheses; nothing else.

    It runs in-process, so every step is bounded before it is taken: at most 200
    characters and 100 syntax nodes, no integer beyond 1000 digits (a power is refused
    from its operands' sizes before it is computed, so 9**9**9**9 is an error at once),
    no infinite float. Integer results print as plain digits ("1913937"), floats in
    Python's shortest round-trip form ("0.5", "1e+20").
    """

    name = "calculator"
    description = (
        "Evaluates an arithmetic expression of integers and decimals: + - * / // % ** and parentheses."
    )
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "The expression, such as 4821*397 or (2+3)**2/7."}
        },
        "required": ["expression"],
        "additionalProperties": False,
    }
    time_limit_s = 1.0

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            raise ToolError(f"calculator: `expression` must be a string, got {type(expression).__name__}")
        return _format_number(evaluate_arithmetic(expression))


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of `expression` (see `CalculatorTool`); `ToolError` names what is wrong."""
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise ToolError(f"calculator: the expression is longer than {_MAX_EXPRESSION_CHARS} characters")
    if not expression.strip():
        raise ToolError("calculator: the expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"calculator: not a valid expression ({e.msg})") from None
    except (ValueError, RecursionError, MemoryError) as e:  # null bytes, absurd nesting
        raise ToolError(f"calculator: not a valid expression ({type(e).__name__})") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > _MAX_NODES:
        raise ToolError(f"calculator: the expression has more than {_MAX_NODES} parts")
    for node in nodes:
        _check_node(node)
    return _eval(tree.body)


def _format_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def _check_node(node: ast.AST) -> None:
    if isinstance(node, ast.Expression | ast.BinOp | ast.UnaryOp):
        return
    if isinstance(node, ast.Add | ast.Sub | ast.Mult | ast.Div | ast.FloorDiv | ast.Mod | ast.Pow):
        return
    if isinstance(node, ast.UAdd | ast.USub):
        return
    if isinstance(node, ast.Constant):
        if type(node.value) is int or type(node.value) is float:
            return
        raise ToolError(f"calculator: only numbers are allowed, not {type(node.value).__name__} literals")
    if type(node) in _OPERATOR_SIGNS:
        raise ToolError(f"calculator: the operator {_OPERATOR_SIGNS[type(node)]} is not allowed")
    if isinstance(node, ast.Name):
        what = f"the name {node.id[:40]!r}"
    else:
        what = _NODE_WORDS.get(type(node), f"{type(node).__name__} syntax")
    raise ToolError(f"calculator: {what} is not allowed; use numbers, + - * / // % ** and parentheses")


def _eval(node: ast.expr) -> int | float:
    if isinstance(node, ast.Constant):
        assert isinstance(node.value, int | float)  # `_check_node` let only these through
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    assert isinstance(node, ast.BinOp)
    left, right = _eval(node.left), _eval(node.right)
    try:
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        return _checked(_BINARY[type(node.op)](left, right))
    except ZeroDivisionError:
        raise ToolError("calculator: division by zero") from None
    except OverflowError:
        raise ToolError("calculator: a number is too large for a float") from None


def _power(base: int | float, exponent: int | float) -> int | float:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        # The result's digits, from the operands: refuse before computing. (|base| >= 2,
        # so an exponent beyond 4 * _MAX_DIGITS is too large whatever the base.)
        if exponent > 4 * _MAX_DIGITS or exponent * math.log10(abs(base)) > _MAX_DIGITS + 1:
            raise ToolError(f"calculator: the result has more than {_MAX_DIGITS} digits")
    value = base**exponent
    if isinstance(value, complex):
        raise ToolError("calculator: the result is not a real number")
    return value


def _checked(value: int | float) -> int | float:
    if isinstance(value, int):
        if abs(value) >= _INT_LIMIT:
            raise ToolError(f"calculator: the result has more than {_MAX_DIGITS} digits")
    elif not math.isfinite(value):
        raise ToolError("calculator: the result is too large for a float (or not a number)")
    return value


# -- the Python interpreter ----------------------------------------------------------------

# Harness frames in a traceback ("<string>" is the runner, never the model's program).
_HARNESS_FRAME = re.compile(r'^  File "<string>", line \d+, in \w+\n', re.MULTILINE)
_SANDBOXES: dict[SandboxConfig, Sandbox] = {}
_SANDBOXES_LOCK = threading.Lock()


def _shared_sandbox(config: SandboxConfig) -> Sandbox:
    with _SANDBOXES_LOCK:
        if config not in _SANDBOXES:
            _SANDBOXES[config] = Sandbox(config)
        return _SANDBOXES[config]


class PythonTool:
    """Runs a Python program in the code verifier's sandbox and returns what it printed.

    The isolation and limits are the sandbox's (`rlax_data.verify.sandbox`): bubblewrap
    namespaces (no network, no host files), CPU, memory, file-size and process limits, a
    wall-clock deadline after which every process of the job is killed. The output is
    stdout then stderr (a traceback without the runner's frames). A program that fails
    raises `ToolError` of kind "timeout" (the wall-clock or CPU limit), "too_large" (it
    wrote more than `sandbox.file_size_mb`, to its output or a file) or "crash" (anything
    else), so the model sees the output and the reason. Sandboxes are shared by config
    across the process (environments are made per trajectory; a sandbox's set-up costs an
    interpreter probe and a self-check, and one serves many threads).

    time_limit_s covers the sandbox's own deadline plus start-up and teardown, so the
    sandbox, not `run_tool`, ends a slow program.
    """

    name = "python"
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "The program; print what you want to see."}},
        "required": ["code"],
        "additionalProperties": False,
    }

    DEFAULT_SANDBOX: Final = SandboxConfig(
        timeout_s=5.0, cpu_s=5, memory_mb=512, file_size_mb=1, max_procs=4, tmpfs_mb=16, workers=1
    )

    def __init__(
        self, sandbox: SandboxConfig | Sandbox | None = None, *, max_code_chars: int = 20_000
    ) -> None:
        if isinstance(sandbox, Sandbox):
            self.sandbox = sandbox
        else:
            self.sandbox = _shared_sandbox(sandbox or self.DEFAULT_SANDBOX)
        self.max_code_chars = max_code_chars
        self.time_limit_s = self.sandbox.config.timeout_s + 5.0
        confined = (
            " in a sandbox without network or files" if self.sandbox.isolation["mode"] == "bwrap" else ""
        )
        self.description = f"Runs a Python 3 program{confined} and returns what it printed."

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError(f"python: `code` must be a string, got {type(code).__name__}")
        if len(code) > self.max_code_chars:
            raise ToolError(f"python: the program is longer than {self.max_code_chars} characters")
        result = self.sandbox.run([ExecJob(mode="run", program=code)])[0]
        output = (result.stdout + _HARNESS_FRAME.sub("", result.stderr)).rstrip("\n")
        if result.status == "ok":
            return output
        limits = self.sandbox.config
        if result.status == "timeout":
            kind, why = "timeout", f"was stopped after {limits.timeout_s:g} s"
        elif "CPU time limit" in result.reason:
            kind, why = "timeout", f"was stopped after {limits.cpu_s} s of CPU time"
        elif "file size limit" in result.reason:
            kind, why = (
                "too_large",
                f"was stopped: it wrote more than {limits.file_size_mb} MB (output or files)",
            )
        else:
            kind, why = "crash", f"failed ({result.reason})"
        raise ToolError(f"the program {why}\n{output}".rstrip("\n"), kind=kind)
