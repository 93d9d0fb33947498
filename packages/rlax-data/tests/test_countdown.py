from __future__ import annotations

from fractions import Fraction

import pytest

from rlax_data import Record
from rlax_data.verify import CountdownVerifier, evaluate_countdown


def _rec(numbers, target, rule="exactly") -> Record:
    return Record(
        id="c", prompt="p", answer="-", metadata={"numbers": numbers, "target": target, "rule": rule}
    )


@pytest.mark.parametrize(
    ("completion", "ok", "reason"),
    [
        ("3*5-2", True, "ok"),
        ("(5-2)*3+4", False, "not available"),
        ("3*5-2=13", True, "ok"),
        ("5*3-2\nmore text", True, "ok"),
        ("3*5", False, "exactly once"),
        ("3*5-2-2", False, "not available"),
        ("3*5+2", False, "evaluates to 17"),
        ("3**5-2", False, "not allowed"),
        ("__import__('os').system('true')", False, "not allowed"),
        ("3*(5-2", False, "syntax error"),
        ("(3+5)/(2-2)", False, "division by zero"),
        ("-3+5*2", False, "not allowed"),
        ("3.0*5-2", False, "not allowed"),
        ("", False, "no expression"),
    ],
)
def test_countdown_checker(completion, ok, reason):
    res = CountdownVerifier().verify([(completion, _rec([3, 5, 2], 13))])[0]
    assert res.correct is ok and res.reward == float(ok)
    assert reason in res.details["reason"]


def test_countdown_at_most_rule_and_division():
    v = CountdownVerifier()
    assert v.verify([("8/2", _rec([8, 2, 7], 4, "at_most"))])[0].correct
    assert not v.verify([("8/2", _rec([8, 2, 7], 4, "exactly"))])[0].correct
    assert v.verify([("7*(8/2)", _rec([8, 2, 7], 28))])[0].correct
    assert v.verify([("(7+1)/2*3", _rec([7, 1, 2, 3], 12))])[0].correct


def test_evaluate_is_exact_and_never_evals():
    assert evaluate_countdown("1/3*3") == (Fraction(1), [1, 3, 3])
    with pytest.raises(ValueError):
        evaluate_countdown("open('x')")
    with pytest.raises(ValueError, match="longer than"):
        evaluate_countdown("1+" * 200 + "1")


def test_countdown_metadata_errors():
    bad = Record(id="c", prompt="p", answer="-", metadata={"numbers": [1]})
    with pytest.raises(ValueError, match="metadata"):
        CountdownVerifier().verify([("1", bad)])
    with pytest.raises(ValueError, match="rule"):
        CountdownVerifier().verify([("1", _rec([1], 1, "sometimes"))])
