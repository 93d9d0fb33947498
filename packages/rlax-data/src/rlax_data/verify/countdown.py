"""Countdown checker: does an arithmetic expression over the given numbers hit the target?

The expression is parsed with `ast` and evaluated by walking the tree with exact
fractions; nothing is ever `eval`ed. Only + - * / on integer literals and parentheses
are allowed. `record.metadata` holds `numbers` (list of int), `target` (int) and `rule`:
"exactly" (each number used exactly once) or "at_most" (each at most once).
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

import msgspec

from rlax_data.datasets import Record
from rlax_data.verify.answers import extract_answer
from rlax_data.verify.base import VerifyItem, VerifyResult

__all__ = ["CountdownConfig", "CountdownVerifier", "evaluate_countdown"]

_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_MAX_EXPR_CHARS = 200


class CountdownError(ValueError):
    pass


def _walk(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _walk(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left = _walk(node.left, used)
        right = _walk(node.right, used)
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        if right == 0:
            raise CountdownError("division by zero")
        return left / right
    raise CountdownError(f"not allowed in a Countdown expression: {type(node).__name__}")


def evaluate_countdown(expression: str) -> tuple[Fraction, list[int]]:
    """Value of `expression` and the integer literals it uses (in order).

    Raises `ValueError` for syntax errors, disallowed syntax or division by zero.
    """
    if len(expression) > _MAX_EXPR_CHARS:
        raise CountdownError(f"expression longer than {_MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CountdownError(f"syntax error: {e.msg}") from None
    used: list[int] = []
    return _walk(tree, used), used


class CountdownConfig(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="kind", tag="countdown"
):
    """extract: which part of the completion holds the expression. A trailing `=target`
    is allowed and ignored (the value is recomputed)."""

    extract: str = "first_line"

    def __post_init__(self) -> None:
        if self.extract not in ("first_line", "last_line", "full", "boxed"):
            raise ValueError(f"field `extract`: unknown mode {self.extract!r}")


def _task_of(record: Record) -> tuple[list[int], int, str]:
    md = record.metadata
    try:
        numbers = [int(x) for x in md["numbers"]]
        target = int(md["target"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"record {record.id!r}: metadata needs `numbers` and `target` for Countdown ({e})"
        ) from None
    rule = md.get("rule", "exactly")
    if rule not in ("exactly", "at_most"):
        raise ValueError(
            f"record {record.id!r}: metadata field `rule` must be 'exactly' or 'at_most', got {rule!r}"
        )
    return numbers, target, rule


class CountdownVerifier:
    def __init__(self, config: CountdownConfig | None = None) -> None:
        self.config = config or CountdownConfig()

    def check(self, expression: str, numbers: list[int], target: int, rule: str) -> tuple[bool, str]:
        """(correct, reason) for one expression."""
        expr = expression.split("=")[0]
        try:
            value, used = evaluate_countdown(expr)
        except CountdownError as e:
            return False, str(e)
        have, want = Counter(used), Counter(numbers)
        extra = have - want
        if extra:
            return False, f"uses numbers not available: {sorted(extra.elements())}"
        if rule == "exactly" and have != want:
            return (
                False,
                f"does not use every number exactly once (unused: {sorted((want - have).elements())})",
            )
        if value != target:
            return False, f"evaluates to {value}, not {target}"
        return True, "ok"

    def verify(self, items: Sequence[VerifyItem]) -> list[VerifyResult]:
        out = []
        for completion, record in items:
            numbers, target, rule = _task_of(record)
            expr = extract_answer(completion, self.config.extract)  # type: ignore[arg-type]
            if expr is None:
                out.append(VerifyResult(reward=0.0, correct=False, details={"reason": "no expression found"}))
                continue
            ok, reason = self.check(expr, numbers, target, rule)
            out.append(
                VerifyResult(
                    reward=float(ok), correct=ok, details={"expression": expr.strip(), "reason": reason}
                )
            )
        return out
