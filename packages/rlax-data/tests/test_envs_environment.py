"""Tool environments: a trajectory's observations and step records, every failure as an
observation (never an exception), the registry, and one environment per trajectory
stepped from many threads at once."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlax_data import Message, Record
from rlax_data.datasets import CodeTests
from rlax_data.envs import (
    BracketToolFormat,
    CalculatorTool,
    Environment,
    EnvStep,
    HermesToolFormat,
    PythonTool,
    ToolEnvironment,
    environment_names,
    make_environment,
    register_environment,
)
from rlax_data.verify import SandboxConfig

RECORD = Record(id="r0", prompt="4821*397=", answer="1913937")


class Echo:
    """Returns its argument repeated `times` times."""

    name = "echo"
    description = "echo"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    time_limit_s = 5.0

    def __init__(self, times: int = 1) -> None:
        self.times = times

    def __call__(self, arguments):
        return arguments["text"] * self.times


class Sleepy:
    name = "sleepy"
    description = "sleeps"
    parameters = {"type": "object", "properties": {}}
    time_limit_s = 0.2

    def __call__(self, arguments):
        time.sleep(1000)


def hermes(name: str, **arguments) -> str:
    """A Hermes call written by hand (not by the format under test)."""
    return '<tool_call>{"name": "' + name + '", "arguments": ' + json.dumps(arguments) + "}</tool_call>"


def test_a_bracket_trajectory_of_the_calculator():
    env = make_environment("calculator", format="bracket")
    assert isinstance(env, Environment) and env.name == "calculator"
    assert env.reset(RECORD) == "4821*397="
    # Until the final answer, the calculator's tool use is not (yet) correct.
    assert env.step("[4821*397]") == EnvStep("(1913937)", done=False, tool_calls=1, tool_correct=False)
    assert env.step("[4821*/397]") == EnvStep(
        "(?)", done=False, tool_calls=1, tool_errors=1, error="bad_arguments", tool_correct=False
    )
    assert env.step("[4821*397") == EnvStep(
        "(?)", done=False, tool_calls=0, tool_errors=1, error="malformed", tool_correct=False
    )
    assert env.step("1913937") == EnvStep("", done=True, tool_correct=True)
    with pytest.raises(RuntimeError, match="step after the trajectory ended"):
        env.step("[1+1]")
    assert env.reset(RECORD) == "4821*397="
    assert env.step("[1+1]").observation == "(2)"


def test_a_hermes_trajectory_shows_errors_to_the_model():
    env = ToolEnvironment([CalculatorTool(), Echo()], HermesToolFormat())
    env.reset(RECORD)
    step = env.step("Let me compute.\n" + hermes("calculator", expression="4821*397"))
    assert step == EnvStep("1913937", done=False, tool_calls=1)
    step = env.step(hermes("calculator", expression="1/0"))
    assert step == EnvStep(
        "Error: calculator: division by zero",
        done=False, tool_calls=1, tool_errors=1, error="bad_arguments",
    )  # fmt: skip
    step = env.step(hermes("search", query="x"))
    assert step == EnvStep(
        "Error: there is no tool named 'search'; the tools are: calculator, echo",
        done=False, tool_calls=1, tool_errors=1, error="unknown_tool",
    )  # fmt: skip
    step = env.step("<tool_call>{not json}</tool_call>")
    assert step.error == "malformed" and (step.tool_calls, step.tool_errors, step.done) == (0, 1, False)
    assert step.observation.startswith("Error: malformed tool call: the call is not valid JSON")
    assert env.step("The answer is 1913937.") == EnvStep("", done=True, reward=None)


def test_long_results_are_cut_and_counted_as_tool_errors():
    # The model still reads the cut result, but the call counts as failed (issue 29: a
    # too_large result used to leave tool_errors at 0, contrary to the README).
    env = ToolEnvironment([Echo(times=1000)], HermesToolFormat(), max_result_chars=50)
    env.reset(RECORD)
    step = env.step(hermes("echo", text="ab"))
    assert (step.tool_calls, step.tool_errors, step.error) == (1, 1, "too_large")
    assert step.observation == "ab" * 25 + "\n[truncated: 1950 more characters]"


def test_a_hung_tool_times_out_and_the_trajectory_goes_on():
    env = ToolEnvironment([Sleepy(), Echo()], HermesToolFormat())
    env.reset(RECORD)
    step = env.step(hermes("sleepy"))
    assert step.error == "timeout" and step.tool_errors == 1
    assert "did not finish within 0.2 s" in step.observation
    assert env.step(hermes("echo", text="still here")).observation == "still here"
    # The environment's limit overrides the tool's own.
    env = ToolEnvironment([Sleepy()], HermesToolFormat(), tool_timeout_s=0.1)
    env.reset(RECORD)
    assert "within 0.1 s" in env.step(hermes("sleepy")).observation


def test_instructions_and_chat_records():
    env = ToolEnvironment([CalculatorTool()], BracketToolFormat(), instructions="Use [expr] to compute.\n")
    assert env.reset(RECORD) == "Use [expr] to compute.\n4821*397="
    chat = Record(id="c", messages=[Message("user", "hi")], answer="x")
    with pytest.raises(ValueError, match="has chat `messages`"):
        env.reset(chat)


def test_bad_environment_configs_name_the_problem():
    with pytest.raises(ValueError, match="at least one tool"):
        ToolEnvironment([], HermesToolFormat())
    with pytest.raises(ValueError, match=r"unique, got \['calculator'\]"):
        ToolEnvironment([CalculatorTool(), CalculatorTool()], HermesToolFormat())
    with pytest.raises(ValueError, match="max_result_chars must be >= 1"):
        ToolEnvironment([CalculatorTool()], HermesToolFormat(), max_result_chars=0)
    with pytest.raises(ValueError, match="tool_timeout_s must be > 0"):
        ToolEnvironment([CalculatorTool()], HermesToolFormat(), tool_timeout_s=0)


def test_tools_schema_is_openai_style_and_a_copy():
    env = make_environment("calculator")
    schema = env.tools_schema()
    assert schema == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": CalculatorTool.description,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "expression": {
                            "type": "string",
                            "description": "The expression, such as 4821*397 or (2+3)**2/7.",
                        }
                    },
                    "required": ["expression"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    schema[0]["function"]["parameters"]["required"].append("oops")
    assert CalculatorTool.parameters["required"] == ["expression"]


def test_registry_built_ins_and_custom_environments():
    assert {"calculator", "python", "tools"} <= set(environment_names())
    with pytest.raises(ValueError, match=r"'chess' is not one of \[.*'calculator'.*\]"):
        make_environment("chess")

    class Fixed:
        name = "fixed"

        def reset(self, record):
            return "go"

        def step(self, model_turn):
            return EnvStep("", done=True, reward=1.0)

    register_environment("test-fixed", Fixed)
    env = make_environment("test-fixed")
    assert isinstance(env, Environment) and env.reset(RECORD) == "go"
    assert env.step("x").reward == 1.0
    with pytest.raises(ValueError, match="'test-fixed' is already registered"):
        register_environment("test-fixed", Fixed)
    with pytest.raises(TypeError, match="unexpected keyword"):
        make_environment("calculator", colour="red")
    with pytest.raises(ValueError, match="tool format: 'xml'"):
        make_environment("calculator", format="xml")


def test_an_environment_by_module_path(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        "from rlax_data.envs import EnvStep\n"
        "class Echo:\n"
        "    name = 'echo'\n"
        "    def __init__(self, **options):\n"
        "        self.options = options\n"
        "    def reset(self, record):\n"
        "        return record.prompt_text()\n"
        "    def step(self, model_turn):\n"
        "        return EnvStep(model_turn.upper(), done=model_turn == 'bye')\n"
        "not_callable = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_environment("my_envs:Echo", format="bracket")
    assert env.options == {"format": "bracket"}
    assert env.reset(RECORD) == RECORD.prompt_text()
    assert env.step("hi") == EnvStep("HI", done=False)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        make_environment("no_such_module:Env")
    with pytest.raises(ValueError, match="'my_envs' has no callable 'not_callable'"):
        make_environment("my_envs:not_callable")
    with pytest.raises(ValueError, match="'my_envs' has no callable 'Missing'"):
        make_environment("my_envs:Missing")


CALC = Record(id="c0", prompt="123*45=", answer="5535")


@pytest.mark.parametrize(
    ("turns", "verdicts"),
    [
        # The right question, its result used: correct.
        (["[123*45]", "5535"], [False, True]),
        # The right question, its result copied wrong: not correct.
        (["[123*45]", "5553"], [False, False]),
        # A wrong question (123*46 = 5658) whose result is copied: not correct.
        (["[123*46]", "5658"], [False, False]),
        # No call: the right answer without the tool is no correct tool use.
        (["5535"], [False]),
        # A failed call, then the right one, used (the final answer's first line counts).
        (["[123*]", "[123*45]", "5535\nmore"], [False, False, True]),
        # The right call, then a wrong one whose result is copied: not the right result used.
        (["[123*45]", "[123*46]", "5658"], [False, False, False]),
    ],
)
def test_the_calculator_judges_whether_its_result_was_right_and_used(turns, verdicts):
    env = make_environment("calculator", format="bracket")
    env.reset(CALC)
    assert [env.step(t).tool_correct for t in turns] == verdicts
    # A judging environment reads earlier calls' results: the service must replay its turns.
    assert env.independent_steps is False


def test_a_sentence_answer_is_judged_against_the_value_it_holds():
    # tool_arithmetic's chat style: the calculator returns the value, the reply is a sentence.
    record = Record(
        id="c2", prompt="What is 123 * 45?", answer="The answer is 5535.", metadata={"value": "5535"}
    )
    right, copied_wrong = (make_environment("calculator", format="bracket") for _ in range(2))
    for env in (right, copied_wrong):
        env.reset(record)
        assert env.step("[123*45]").tool_correct is False
    assert right.step("The answer is 5535.").tool_correct is True
    assert copied_wrong.step("The answer is 5553.").tool_correct is False


def test_environments_that_cannot_judge_say_none():
    unjudged = make_environment("calculator", format="bracket", judge=None)
    unjudged.reset(CALC)
    assert [unjudged.step(t).tool_correct for t in ("[123*45]", "5535")] == [None, None]
    assert unjudged.independent_steps is True
    tools = make_environment("tools", format="bracket")
    tools.reset(CALC)
    assert [tools.step(t).tool_correct for t in ("[123*45]", "5535")] == [None, None]
    # A record without an answer cannot be judged.
    calculator = make_environment("calculator", format="bracket")
    calculator.reset(Record(id="c1", prompt="123*45=", tests=CodeTests(script="assert True")))
    assert [calculator.step(t).tool_correct for t in ("[123*45]", "5535")] == [None, None]


def test_python_and_tools_environments_run_programs():
    config = SandboxConfig(timeout_s=5.0, cpu_s=2, memory_mb=256, file_size_mb=1, workers=1)
    env = make_environment("tools", sandbox=config, max_result_chars=100)
    assert [t["function"]["name"] for t in env.tools_schema()] == ["calculator", "python"]
    env.reset(RECORD)
    step = env.step(hermes("python", code="print(sum(range(101)))"))
    assert step == EnvStep("5050", done=False, tool_calls=1)
    step = env.step(hermes("python", code="print(open('/etc/passwd').read())"))
    assert step.error == "crash" and "No such file or directory" in step.observation
    python = make_environment("python", sandbox=config, format="bracket")
    python_tool = python.tools["python"]
    assert isinstance(python_tool, PythonTool)
    # One sandbox for every environment of a config: environments are made per trajectory.
    assert python_tool.sandbox is env.tools["python"].sandbox


def test_environments_of_many_trajectories_step_in_parallel():
    envs = [make_environment("calculator", format="bracket") for _ in range(32)]
    for env in envs:
        env.reset(RECORD)

    def trajectory(i: int) -> list[EnvStep]:
        env = envs[i]
        return [env.step(f"[{i}*{i + 1000}]"), env.step(f"[{i}**2+1]"), env.step(str(i))]

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(trajectory, range(32)))
    for i, steps in enumerate(results):
        assert steps == [
            EnvStep(f"({i * (i + 1000)})", done=False, tool_calls=1, tool_correct=False),
            EnvStep(f"({i * i + 1})", done=False, tool_calls=1, tool_correct=False),
            EnvStep("", done=True, tool_correct=False),
        ]
