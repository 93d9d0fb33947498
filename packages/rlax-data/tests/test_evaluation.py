from __future__ import annotations

import itertools
import json
import math
import random

import pytest

from rlax_data import Record, avg_at_k, evaluate, maj_at_k, pass_at_k
from rlax_data.tasks import ArithmeticTask
from rlax_data.verify.base import VerifyResult


@pytest.mark.parametrize("n", [1, 2, 5, 10, 50, 200])
def test_pass_at_k_closed_forms(n):
    for k in range(1, n + 1):
        assert pass_at_k(n, 0, k) == 0.0
        assert pass_at_k(n, n, k) == 1.0
    for c in range(n + 1):
        assert pass_at_k(n, c, 1) == pytest.approx(c / n, abs=1e-12)
        assert pass_at_k(n, c, n) == (1.0 if c > 0 else 0.0)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n():
    # The binomials here overflow a float; the product form does not.
    v = pass_at_k(2000, 3, 100)
    assert 0.0 < v < 1.0
    assert v == pytest.approx(1 - math.comb(1997, 100) / math.comb(2000, 100), rel=1e-9)
    with pytest.raises(ValueError):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError):
        pass_at_k(5, 1, 6)


def test_avg_and_maj_at_k():
    correct = [True, False, False, True]
    assert avg_at_k(correct, 2) == 0.5 and avg_at_k(correct, 4) == 0.5
    answers = ["3", "4", "4", "3"]
    assert maj_at_k(answers, [True, False, False, True], 3) == 0.0  # "4" wins 2-1
    assert maj_at_k(answers, [True, False, False, True], 1) == 1.0
    assert maj_at_k(["3", "4", "4", "3"], [True, False, False, True], 4) == 1.0  # tie: first seen
    assert maj_at_k([None, None, "7"], [False, False, True], 3) == 1.0
    assert maj_at_k([None, None], [False, False], 2) == 0.0


class HalfRightSampler:
    """Deterministic: sample j of a prompt is right iff j is even."""

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers

    def __call__(self, prompts, n):
        return [[self.answers[p] if j % 2 == 0 else "wrong" for j in range(n)] for p in prompts]


def test_evaluate_writes_json_and_markdown(tmp_path):
    task = ArithmeticTask()
    recs = task.generate(10, seed=0)
    sampler = HalfRightSampler({r.prompt: r.answer for r in recs})
    rep = evaluate(recs, sampler, task.verifier(), n=4, ks=[1, 2, 4], batch_size=3, out_dir=tmp_path)
    m = rep.metrics["all"]
    assert m["avg@4"] == 0.5 and m["pass@1"] == pytest.approx(0.5)
    assert m["pass@2"] == pytest.approx(pass_at_k(4, 2, 2)) and m["pass@4"] == 1.0
    assert m["maj@1"] == 1.0  # the first sample is right
    assert rep.metrics["arithmetic"] == m and rep.counts == {"all": 10, "arithmetic": 10}
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["metrics"]["all"]["pass@4"] == 1.0 and len(saved["per_prompt"]) == 10
    md = (tmp_path / "eval.md").read_text()
    assert md.splitlines()[0].startswith("| group | prompts | pass@1 | pass@2 | pass@4 |")
    assert "| all | 10 | 0.5000 |" in md


def test_evaluate_rejects_bad_sampler_output():
    recs = ArithmeticTask().generate(2, seed=0)
    with pytest.raises(ValueError, match="sampler returned"):
        evaluate(recs, lambda prompts, n: [["1"]] * len(prompts), ArithmeticTask().verifier(), n=2)
    with pytest.raises(ValueError, match="ks"):
        evaluate(recs, lambda p, n: [["1"] * n for _ in p], ArithmeticTask().verifier(), n=2, ks=[3])
    chat = [Record(id="c", messages=[{"role": "user", "content": "x"}], answer="1")]  # type: ignore[list-item]
    with pytest.raises(ValueError, match="render"):
        evaluate(chat, lambda p, n: [["1"] * n for _ in p], ArithmeticTask().verifier(), n=1)


@pytest.mark.parametrize("n", range(1, 8))
def test_avg_at_k_is_the_mean_over_every_choice_of_k_samples(n):
    rng = random.Random(n)
    for _ in range(5):
        correct = [rng.random() < 0.4 for _ in range(n)]
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            brute = sum(sum(correct[i] for i in s) / k for s in subsets) / len(subsets)
            assert avg_at_k(correct, k) == pytest.approx(brute, abs=1e-12)
    # The first k samples alone would say 1.0 here; all six say 4/6.
    assert avg_at_k([True, True, False, False, True, True], 2) == pytest.approx(4 / 6)


class FencedCodeVerifier:
    """A code-style verifier: passes or fails a program, extracts no answer."""

    def verify(self, items):
        return [
            VerifyResult(
                reward=float("return x * x" in c), correct="return x * x" in c, details={"passed": 1}
            )
            for c, _ in items
        ]


def test_maj_at_k_is_not_reported_for_a_task_without_extracted_answers(tmp_path):
    code = [Record(id=f"c{i}", prompt=f"square {i}", answer="-", task="code") for i in range(3)]
    arith = ArithmeticTask().generate(3, seed=1)

    def sampler(prompts, n):
        # Every code sample starts with the same fence line; one in four is right.
        right = "```python\ndef sq(x):\n    return x * x\n```"
        wrong = "```python\ndef sq(x):\n    return x\n```"
        return [[right if j == 0 else wrong for j in range(n)] for _ in prompts]

    rep = evaluate(code, sampler, FencedCodeVerifier(), n=4, ks=[1, 4], out_dir=tmp_path)
    assert set(rep.metrics["code"]) == {"pass@1", "pass@4", "avg@1", "avg@4"}
    assert rep.metrics["code"]["avg@1"] == pytest.approx(0.25) and rep.metrics["code"]["pass@4"] == 1.0
    assert all(not any(key.startswith("maj@") for key in row) for row in rep.per_prompt)
    assert "maj@" not in (tmp_path / "eval.md").read_text()

    # A mixed run: the arithmetic group votes, the code group and "all" (which holds code) do not.
    task = ArithmeticTask()
    answers = {r.prompt: r.answer for r in arith}

    def mixed(prompts, n):
        return [
            [answers[p]] * n if p in answers else ["```python\ndef sq(x):\n    return x\n```"] * n
            for p in prompts
        ]

    class Routes:
        def verify(self, items):
            arith_items = [(c, r) for c, r in items if r.task == "arithmetic"]
            scored = iter(task.verifier().verify(arith_items))
            code_scored = iter(FencedCodeVerifier().verify([(c, r) for c, r in items if r.task == "code"]))
            return [next(scored) if r.task == "arithmetic" else next(code_scored) for _, r in items]

    rep = evaluate(arith + code, mixed, Routes(), n=2, ks=[1, 2])
    assert rep.metrics["arithmetic"]["maj@2"] == 1.0 and rep.metrics["arithmetic"]["avg@2"] == 1.0
    assert "maj@2" not in rep.metrics["code"] and "maj@2" not in rep.metrics["all"]
    md = rep.markdown()
    assert "| maj@1 | maj@2 |" in md and "| code | 3 | 0.0000 | 0.0000 | 0.0000 | 0.0000 | - | - |" in md


def test_maj_at_k_counts_a_prompt_without_any_answer_as_wrong():
    recs = ArithmeticTask().generate(2, seed=5)
    first = recs[0].prompt

    def sampler(prompts, n):
        # The first prompt gets only blank completions: no answer to extract, nothing to vote on.
        return [["  \n"] * n if p == first else [recs[1].answer] * n for p in prompts]

    rep = evaluate(recs, sampler, ArithmeticTask().verifier(), n=3, ks=[3])
    assert [row["maj@3"] for row in rep.per_prompt] == [0.0, 1.0]
    assert rep.metrics["all"]["maj@3"] == 0.5
