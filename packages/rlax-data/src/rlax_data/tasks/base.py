"""What every built-in task provides, and the seeded RNG they share.

Tasks are generated deterministically: record `i` of seed `s` depends only on
(task name, config, s, i), so generating 100 or 1000 records gives the same first 100.
The easy settings have short prompts and answers over a small alphabet, so a tiny
character-level model can learn them in minutes on a CPU.
"""

from __future__ import annotations

import random
from typing import Any, Protocol, runtime_checkable

from rlax_data.datasets import Record
from rlax_data.verify.base import Verifier

__all__ = ["Task", "TaskFormat", "record_rng"]


class TaskFormat:
    """How prompts and targets are written.

    prompt_template: filled with the record's fields (e.g. "{a}+{b}=").
    answer_template: the training target before EOS (e.g. "{answer}"); a model's
    completion is the answer followed by the tokenizer's end-of-sequence token.
    alphabet: every character prompts and answers use (for a character tokenizer).
    """

    __slots__ = ("alphabet", "answer_template", "prompt_template")

    def __init__(self, prompt_template: str, answer_template: str, alphabet: str) -> None:
        self.prompt_template = prompt_template
        self.answer_template = answer_template
        self.alphabet = alphabet

    def __repr__(self) -> str:
        return f"TaskFormat({self.prompt_template!r}, {self.answer_template!r}, {self.alphabet!r})"


@runtime_checkable
class Task(Protocol):
    """A built-in task: deterministic records plus the verifier that scores them."""

    name: str
    format: TaskFormat

    def generate(self, n: int, *, seed: int) -> list[Record]:
        """`n` records; record i depends only on (config, seed, i)."""
        ...

    def verifier(self) -> Verifier: ...


def record_rng(task: str, config: Any, seed: int, index: int) -> random.Random:
    """The RNG of one record. Python's Mersenne Twister seeded from a string is stable
    across Python versions and platforms (string seeds go through SHA-512)."""
    return random.Random(f"{task}|{config!r}|{seed}|{index}")


def check_count(n: int) -> None:
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
