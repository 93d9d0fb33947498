from __future__ import annotations

import threading

import pytest

from rlax_data import Record
from rlax_data.verify import (
    ExactMatchConfig,
    ExactMatchVerifier,
    MathConfig,
    MathVerifier,
    Verifier,
    extract_answer,
    normalize_answer,
)

# (gold answer, completion, equivalent?)
MATH_TABLE = [
    # fractions vs decimals
    ("1/2", "The answer is $\\boxed{0.5}$", True),
    ("\\frac{1}{2}", "0.5", True),
    ("0.5", "\\boxed{\\frac{1}{2}}", True),
    ("\\frac{3}{4}", "So we get $\\frac{6}{8}$.", True),
    ("1/3", "\\boxed{0.333333}", True),
    ("1/3", "\\boxed{0.33}", False),
    # \boxed{} extraction: the boxed answer wins over other numbers in the text
    ("2", "first 3 then \\boxed{2}", True),
    ("2", "\\boxed{3} wait, 2?", False),
    ("12", "The final answer is 12.", True),
    ("12", "The final answer is 13.", False),
    ("3", "\\boxed{4}", False),
    ("2", "no answer here", False),
    # units and percent
    ("10", "$10\\text{ cm}$", True),
    ("10", "\\boxed{10 \\text{ meters}}", True),
    ("10", "\\boxed{11 \\text{ meters}}", False),
    ("5", "\\boxed{5\\%}", True),
    # intervals and sets
    ("[1,2)", "\\boxed{[1,2)}", True),
    ("[1,2)", "\\boxed{(1,2)}", False),
    ("[1,2)", "\\boxed{[1,2]}", False),
    ("1,2", "\\boxed{\\{1,2\\}}", True),
    # symbolic equivalence
    ("\\sqrt{2}", "\\boxed{\\frac{2}{\\sqrt{2}}}", True),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", True),
    ("\\pi", "\\boxed{3.14}", False),
]


def _rec(answer: str, i: int = 0) -> Record:
    return Record(id=f"m{i}", prompt="q", answer=answer)


def test_math_verify_table():
    v = MathVerifier()
    assert isinstance(v, Verifier)
    results = v.verify([(comp, _rec(gold, i)) for i, (gold, comp, _) in enumerate(MATH_TABLE)])
    got = [(g, c, r.correct) for (g, c, _), r in zip(MATH_TABLE, results)]
    assert got == [(g, c, want) for g, c, want in MATH_TABLE]
    assert all(r.reward == float(r.correct) for r in results)


def test_math_boxed_only_ignores_unboxed_text():
    v = MathVerifier(MathConfig(boxed_only=True))
    assert v.verify([("the answer is 12", _rec("12"))])[0].correct is False
    assert v.verify([("so \\boxed{12}", _rec("12"))])[0].correct is True


def test_math_verifier_off_main_thread_needs_no_timeout():
    errors: list[Exception] = []
    ok: list[bool] = []

    def run(cfg: MathConfig) -> None:
        try:
            ok.append(MathVerifier(cfg).verify([("\\boxed{0.5}", _rec("1/2"))])[0].correct)
        except RuntimeError as e:
            errors.append(e)

    for cfg in (MathConfig(), MathConfig(timeout_s=None)):
        t = threading.Thread(target=run, args=(cfg,))
        t.start()
        t.join()
    assert len(errors) == 1 and "timeout_s" in str(errors[0])
    assert ok == [True]


def test_math_unparseable_gold_is_an_error():
    with pytest.raises(ValueError, match="field `answer`"):
        MathVerifier().verify([("1", _rec(""))])


def test_normalised_exact_match():
    assert normalize_answer("  Paris.  ") == "paris"
    assert normalize_answer("New   York") == "new york"
    assert normalize_answer("Ab", case_sensitive=True) == "Ab"
    v = ExactMatchVerifier()
    recs = [Record(id=str(i), prompt="p", answer=a) for i, a in enumerate(["19", "Paris", "19"])]
    res = v.verify([("19\ntrailing junk", recs[0]), (" paris. ", recs[1]), ("\n", recs[2])])
    assert [r.correct for r in res] == [True, True, False]
    assert res[2].details["reason"] == "no answer found"
    cs = ExactMatchVerifier(ExactMatchConfig(case_sensitive=True))
    assert cs.verify([("paris", recs[1])])[0].correct is False


def test_extract_answer_modes():
    text = "reasoning\n\\boxed{\\frac{1}{2}} ok\nlast"
    assert extract_answer(text, "first_line") == "reasoning"
    assert extract_answer(text, "last_line") == "last"
    assert extract_answer(text, "boxed") == "\\frac{1}{2}"
    assert extract_answer("no box", "boxed") is None
    assert extract_answer(text, "full") == text


def test_exact_match_needs_answer():
    from rlax_data import CodeTests

    rec = Record(id="c", prompt="p", tests=CodeTests(script="pass"))
    with pytest.raises(ValueError, match="field `answer`"):
        ExactMatchVerifier().verify([("x", rec)])
