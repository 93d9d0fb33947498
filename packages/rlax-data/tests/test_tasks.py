from __future__ import annotations

from fractions import Fraction

import pytest

from rlax_data import ArithmeticTask, CountdownTask, SortingTask, Task, make_task
from rlax_data.verify import evaluate_countdown

ALL = [(n, d) for n in ("arithmetic", "countdown", "sorting") for d in ("easy", "medium", "hard")]


@pytest.mark.parametrize(("name", "difficulty"), ALL)
def test_reference_answers_verify_and_generation_is_deterministic(name, difficulty):
    task = make_task(name, difficulty)
    assert isinstance(task, Task)
    recs = task.generate(200, seed=7)
    assert recs == make_task(name, difficulty).generate(200, seed=7)
    assert task.generate(20, seed=7) == recs[:20]  # prefix-stable
    assert recs != task.generate(200, seed=8)
    assert len({r.id for r in recs}) == 200
    results = task.verifier().verify([(r.answer, r) for r in recs])
    assert all(r.correct and r.reward == 1.0 for r in results)
    alphabet = set(task.format.alphabet)
    for r in recs:
        assert set(r.prompt) <= alphabet and set(r.answer) <= alphabet, (r.prompt, r.answer)


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "sorting"])
def test_easy_setting_is_short(name):
    recs = make_task(name, "easy").generate(500, seed=0)
    assert max(len(r.prompt) for r in recs) <= 12
    assert max(len(r.answer) for r in recs) <= 8


def test_arithmetic_values():
    t = ArithmeticTask(digits=3, operands=3, ops="+-*")
    for r in t.generate(300, seed=3):
        expr = r.prompt.rstrip("=")
        value, _ = evaluate_countdown(expr)
        assert value == int(r.answer) and int(r.answer) >= 0
    wrong = ArithmeticTask().generate(5, seed=1)
    res = ArithmeticTask().verifier().verify([(str(int(r.answer) + 1), r) for r in wrong])
    assert not any(x.correct for x in res)


def test_countdown_targets_reachable_and_rules():
    t = CountdownTask.preset("medium")
    for r in t.generate(300, seed=5):
        value, used = evaluate_countdown(r.answer)
        assert value == Fraction(r.metadata["target"])
        assert sorted(used) == sorted(r.metadata["numbers"])
        assert r.prompt == ",".join(map(str, r.metadata["numbers"])) + f">{r.metadata['target']}:"


def test_sorting_values():
    for r in SortingTask(length=9, descending=True).generate(50, seed=2):
        digits = r.prompt[2:-1]
        assert r.answer == "".join(sorted(digits, reverse=True))


def test_long_tailed_sorting_lengths_and_unchanged_fixed_records():
    """`max_length`: record lengths from a Pareto tail (median 3, a tenth 11 or more, a few
    at the cap), each answer as long as its digits; the fixed-length records are those of
    the task before the tail existed (the first three of seed 0, written down then)."""
    records = SortingTask(length=2, max_length=24, tail=1.2).generate(2000, seed=0)
    lengths = sorted(len(r.answer) for r in records)
    assert lengths[0] == 2 and lengths[1000] == 3 and lengths[1800] >= 11 and lengths[-1] == 24
    for r in records[:50]:
        assert r.answer == "".join(sorted(r.prompt[2:-1])) and r.metadata["difficulty"]["length"] == len(
            r.answer
        )
    assert [r.prompt for r in SortingTask().generate(3, seed=0)] == ["s:6375=", "s:1355=", "s:5453="]
    with pytest.raises(ValueError, match="field `max_length`"):
        SortingTask(length=4, max_length=3)
    with pytest.raises(ValueError, match="field `tail`"):
        SortingTask(max_length=8, tail=0.0)


def test_bad_task_config_names_field():
    with pytest.raises(ValueError, match="field `digits`"):
        ArithmeticTask(digits=0)
    with pytest.raises(ValueError, match="field `ops`"):
        CountdownTask(ops="+^")
    with pytest.raises(ValueError, match="difficulty"):
        make_task("sorting", "legendary")


def test_arithmetic_sentence_style_poses_the_bare_problems_and_checks_format_and_value():
    bare = ArithmeticTask(digits=1).generate(100, seed=4)
    task = ArithmeticTask(digits=1, style="sentence")
    recs = task.generate(100, seed=4)
    assert recs == task.generate(100, seed=4) and task.generate(10, seed=4) == recs[:10]
    alphabet = set(task.format.alphabet)
    for b, r in zip(bare, recs, strict=True):
        a, c = b.prompt.rstrip("=").split("+")
        assert r.prompt == f'What is {a} + {c}? Start your reply with "The answer is".'
        assert r.answer == f"The answer is {b.answer}." and r.metadata["value"] == int(b.answer)
        assert set(r.prompt) <= alphabet and set(r.answer) <= alphabet
    assert len({r.id for r in recs}) == 100 and not {r.id for r in recs} & {b.id for b in bare}
    r = recs[0]
    value = r.metadata["value"]
    replies = [
        f"The answer is {value}.",  # the reference
        f"the answer is {value}\nBecause I added them.",  # only the first line counts
        f"{value}",  # right value, wrong format
        f"The answer is {value + 1}.",  # right format, wrong value
        f"The answer is {value}. I added them.",  # more on the first line
    ]
    got = [x.correct for x in task.verifier().verify([(reply, r) for reply in replies])]
    assert got == [True, True, False, False, False]
    with pytest.raises(ValueError, match="field `style`"):
        ArithmeticTask(style="prose")  # type: ignore[arg-type]


def test_arithmetic_sentence_style_spaces_every_operator():
    for r in ArithmeticTask(digits=2, operands=3, ops="+-*", style="sentence").generate(50, seed=1):
        expression = r.prompt.removeprefix("What is ").split("?")[0]
        value, _ = evaluate_countdown(expression.replace(" ", ""))
        assert value == r.metadata["value"] and "  " not in expression
        assert all(f" {op} " in expression for op in "+-*" if op in expression)
