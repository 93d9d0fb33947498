"""The tool-arithmetic task: big products posed bare, deterministic, spelled in a small
alphabet, and SFT demonstrations that the calculator environment replays exactly."""

from __future__ import annotations

import re

import pytest

from rlax_data import Record, Task, ToolArithmeticTask, make_environment, make_task
from rlax_data.envs import HermesToolFormat, ToolCall

SHAPES = {"easy": (3, 2), "medium": (4, 3), "hard": (5, 4)}


@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_presets_pose_products_of_the_stated_sizes(difficulty):
    task = make_task("tool_arithmetic", difficulty)
    assert isinstance(task, Task) and isinstance(task, ToolArithmeticTask)
    da, db = SHAPES[difficulty]
    records = task.generate(300, seed=5)
    pattern = re.compile(rf"([1-9]\d{{{da - 1}}})\*([1-9]\d{{{db - 1}}})=")
    for r in records:
        match = pattern.fullmatch(r.prompt)
        assert match, r.prompt
        assert r.answer == str(int(match[1]) * int(match[2]))
        assert r.metadata["expression"] == r.prompt[:-1] and r.task == "tool_arithmetic"
    assert len({r.prompt for r in records}) > 290


def test_hand_worked_record_and_sums():
    records = ToolArithmeticTask(digits_a=2, digits_b=1, ops="+").generate(50, seed=0)
    for r in records:
        a, b = r.prompt.rstrip("=").split("+")
        assert len(a) == 2 and len(b) == 1 and r.answer == str(int(a) + int(b))
    mixed = ToolArithmeticTask(ops="*+").generate(200, seed=0)
    assert {"*", "+"} <= {c for r in mixed for c in r.prompt}


def test_generation_is_deterministic_and_prefix_stable():
    task = ToolArithmeticTask.preset("medium")
    records = task.generate(100, seed=3)
    assert records == ToolArithmeticTask.preset("medium").generate(100, seed=3)
    assert task.generate(10, seed=3) == records[:10]
    assert records != task.generate(100, seed=4)
    assert len({r.id for r in records}) == 100
    # The environment and the SFT mix do not change the problems.
    other = ToolArithmeticTask(digits_a=4, digits_b=3, environment="tools", sft_tool_fraction=0.9)
    assert [r.prompt for r in other.generate(100, seed=3)] == [r.prompt for r in records]
    with pytest.raises(ValueError, match="n: must be >= 0"):
        task.generate(-1, seed=0)


def test_the_verifier_wants_the_exact_answer():
    task = ToolArithmeticTask()
    record = Record(id="x", prompt="482*39=", answer="18798", task="tool_arithmetic")
    results = task.verifier().verify(
        [("18798", record), ("18797", record), ("18798\nmore", record), ("", record)]
    )
    assert [r.correct for r in results] == [True, False, True, False]
    generated = task.generate(100, seed=1)
    assert all(r.correct for r in task.verifier().verify([(r.answer, r) for r in generated]))


def test_the_alphabet_spells_prompts_answers_calls_and_results():
    for difficulty in SHAPES:
        task = ToolArithmeticTask.preset(difficulty)
        alphabet = set(task.format.alphabet)
        assert alphabet == set("0123456789*=[]()?")
        assert len(task.format.alphabet) == len(alphabet)
        for r in task.generate(200, seed=0):
            for use_tool in (True, False):
                for text, _ in task.demonstration(r, use_tool=use_tool, tool_format=None):
                    assert set(text) <= alphabet, text
            assert set(r.prompt) <= alphabet and set("(?)") <= alphabet
    assert set(ToolArithmeticTask(ops="+*").format.alphabet) == set("0123456789*+=[]()?")


def test_demonstrations_hand_written():
    task = ToolArithmeticTask(digits_a=4, digits_b=3)
    record = Record(id="d", prompt="4821*397=", answer="1913937", metadata={"expression": "4821*397"})
    assert task.demonstration(record, use_tool=True, tool_format=None) == [
        ("[4821*397]", True),
        ("(1913937)", False),
        ("1913937", True),
    ]
    assert task.demonstration(record, use_tool=False, tool_format=None) == [("1913937", True)]
    assert task.demonstration(record, use_tool=True, tool_format=HermesToolFormat()) == [
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821*397"}}\n</tool_call>', True),
        ("1913937", False),
        ("1913937", True),
    ]
    bare = Record(id="e", prompt="4821*397=", answer="1913937")
    with pytest.raises(ValueError, match="record 'e': metadata field `expression`"):
        task.demonstration(bare, use_tool=True, tool_format=None)


@pytest.mark.parametrize("format_name", ["bracket", "hermes"])
def test_the_environment_replays_every_tool_demonstration(format_name):
    """The demonstrated environment turn is exactly what the environment answers."""
    from rlax_data.envs import make_tool_format

    fmt = make_tool_format(format_name)
    task = ToolArithmeticTask.preset("hard")
    for record in task.generate(50, seed=2):
        env = make_environment(task.environment, format=fmt)
        assert env.reset(record) == record.prompt
        (call, _), (result, _), (answer, _) = task.demonstration(record, use_tool=True, tool_format=fmt)
        step = env.step(call)
        assert (step.observation, step.done, step.tool_errors) == (result, False, 0)
        assert env.step(answer).done


def test_tool_use_in_demonstrations_is_fixed_per_record_and_follows_the_fraction():
    records = ToolArithmeticTask().generate(2000, seed=0)
    half = ToolArithmeticTask()
    uses = [half.uses_tool_in_demonstration(r) for r in records]
    assert uses == [ToolArithmeticTask().uses_tool_in_demonstration(r) for r in records]
    assert 900 <= sum(uses) <= 1100  # Binomial(2000, 0.5): mean 1000, sd 22
    assert not any(ToolArithmeticTask(sft_tool_fraction=0.0).uses_tool_in_demonstration(r) for r in records)
    assert all(ToolArithmeticTask(sft_tool_fraction=1.0).uses_tool_in_demonstration(r) for r in records)
    # Raising the fraction only adds tool users.
    low = {r.id for r in records if ToolArithmeticTask(sft_tool_fraction=0.3).uses_tool_in_demonstration(r)}
    high = {r.id for r in records if ToolArithmeticTask(sft_tool_fraction=0.6).uses_tool_in_demonstration(r)}
    assert low < high and 500 <= len(low) <= 700


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"digits_a": 0}, "field `digits_a`"),
        ({"digits_b": 31}, "field `digits_b`"),
        ({"ops": "-"}, "field `ops`"),
        ({"ops": ""}, "field `ops`"),
        ({"sft_tool_fraction": 1.5}, "field `sft_tool_fraction`"),
    ],
)
def test_bad_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToolArithmeticTask(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="'legendary' is not one of"):
        make_task("tool_arithmetic", "legendary")


def test_the_chat_style_asks_in_words_and_wants_a_sentence():
    chat = ToolArithmeticTask(style="chat").generate(50, seed=2)
    bare = ToolArithmeticTask().generate(50, seed=2)
    for c, b in zip(chat, bare, strict=True):
        a, x = b.metadata["expression"].split("*")
        # The same numbers as the bare style for the same (config, seed, index).
        assert c.prompt == f"What is {a} * {x}?" and c.metadata["expression"] == b.metadata["expression"]
        assert c.answer == f"The answer is {b.answer}." and c.metadata["value"] == b.answer
        assert c.id.startswith("tool_arithmetic-chat-") and c.id != b.id
    record = chat[0]
    results = (
        ToolArithmeticTask(style="chat")
        .verifier()
        .verify(
            [(record.answer, record), (record.metadata["value"], record), (record.answer + "\nso", record)]
        )
    )
    assert [r.correct for r in results] == [True, False, True]
    with pytest.raises(ValueError, match="field `style`"):
        ToolArithmeticTask(style="verbose")  # type: ignore[arg-type]


def test_the_chat_example_is_a_worked_conversation_that_the_environment_replays():
    fmt = HermesToolFormat()
    assert ToolArithmeticTask().example_messages(fmt) == []
    task = ToolArithmeticTask(style="chat")
    messages = task.example_messages(fmt)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[0]["content"] == "What is 23 * 41?"
    assert messages[1]["content"] == fmt.render_call(ToolCall("calculator", {"expression": "23*41"}))
    # The tool's message is the value alone (the chat template frames it), the reply a sentence.
    assert messages[2]["content"] == "943" and messages[3]["content"] == "The answer is 943."
    # Replayed through the calculator environment, the example is correct use of the tool.
    example = Record(
        id="ex", prompt=messages[0]["content"], answer=messages[3]["content"],
        metadata={"expression": "23*41", "value": "943"},
    )  # fmt: skip
    env = make_environment("calculator", format="hermes")
    env.reset(example)
    step = env.step(messages[1]["content"])
    assert (step.observation, step.tool_calls, step.tool_errors) == ("943", 1, 0)
    final = env.step(messages[3]["content"])
    assert final.done and final.tool_correct is True
    # A demonstration of a chat record feeds the calculator's value back, not the sentence.
    [record] = task.generate(1, seed=0)
    assert task.demonstration(record, use_tool=True, tool_format=fmt)[1] == (record.metadata["value"], False)


def test_task_overrides_name_their_source():
    task = make_task("tool_arithmetic", "easy", {"style": "chat", "digits_b": 3})
    assert (task.style, task.digits_a, task.digits_b) == ("chat", 3, 3)
    with pytest.raises(ValueError, match=r"--task-arg = \{'colour': 'red'\}: .*colour"):
        make_task("tool_arithmetic", "easy", {"colour": "red"}, source="--task-arg")
    with pytest.raises(ValueError, match="field `style`"):
        make_task("tool_arithmetic", "easy", {"style": "loud"})
