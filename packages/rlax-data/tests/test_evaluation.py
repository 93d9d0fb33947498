from __future__ import annotations

import itertools
import json
import math

import pytest

from rlax_data import Record, avg_at_k, evaluate, maj_at_k, pass_at_k
from rlax_data.tasks import ArithmeticTask


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
