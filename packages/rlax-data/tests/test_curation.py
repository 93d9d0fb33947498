from __future__ import annotations

import hashlib
import json
import os
import random

import pytest
from rich.console import Console

from rlax_data import PromptStream, Record, load_jsonl
from rlax_data.curation import (
    ContaminationConfig,
    DedupConfig,
    PassRateConfig,
    bucket_sources,
    deduplicate,
    difficulty_buckets,
    filter_by_length,
    find_contamination,
    prefilter_by_pass_rate,
    render_summary,
)
from rlax_data.tasks import ArithmeticTask, CountdownTask

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
    "quebec romeo sierra tango uniform victor whiskey xray yankee zulu apple river stone cloud maple ember"
).split()


def _sentence(rng: random.Random, n: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _perturb(text: str, rng: random.Random, edits: int) -> str:
    words = text.split()
    for _ in range(edits):
        i = rng.randrange(len(words))
        words[i] = rng.choice([w for w in WORDS if w != words[i]])
    return " ".join(words)


def test_planted_exact_and_near_duplicates_are_found():
    rng = random.Random(0)
    base = [Record(id=f"r{i}", prompt=_sentence(rng), answer="x") for i in range(300)]
    planted_exact = {f"e{i}": base[i].id for i in range(0, 40, 4)}
    planted_near = {f"n{i}": base[i].id for i in range(100, 200, 5)}
    recs = list(base)
    for dup, src in planted_exact.items():
        # same text up to case, punctuation and spacing
        text = "  " + base[int(src[1:])].prompt.upper().replace(" ", " ,  ") + "!"
        recs.append(Record(id=dup, prompt=text, answer="x"))
    for dup, src in planted_near.items():
        recs.append(Record(id=dup, prompt=_perturb(base[int(src[1:])].prompt, rng, 1), answer="x"))
    tail = recs[300:]
    rng.shuffle(tail)
    recs = recs[:300] + tail
    kept, rep = deduplicate(recs, DedupConfig(threshold=0.7))
    removed = set(rep.removed)
    assert set(planted_exact) <= removed
    assert set(planted_near) <= removed
    assert removed <= set(planted_exact) | set(planted_near)  # no original was dropped
    assert {g[0]: set(g[1:]) for g in rep.exact_groups} == {
        src: {d for d, s in planted_exact.items() if s == src} for src in set(planted_exact.values())
    }
    assert {(a, b) for a, b, _ in rep.near_pairs} == {(src, d) for d, src in planted_near.items()}
    assert all(s >= 0.7 for _, _, s in rep.near_pairs)
    assert rep.kept == len(kept) == 300
    exact_only, rep2 = deduplicate(recs, DedupConfig(near=False))
    assert len(exact_only) == 300 + len(planted_near) and rep2.near_pairs == []


def test_contamination_against_an_eval_set():
    rng = random.Random(1)
    eval_set = [Record(id=f"ev{i}", prompt=_sentence(rng, 30), answer="x") for i in range(20)]
    train = [Record(id=f"t{i}", prompt=_sentence(rng, 30), answer="x") for i in range(50)]
    leaked = [
        Record(id="leak0", prompt="Question: " + eval_set[3].prompt, answer="x"),
        Record(id="leak1", prompt=eval_set[7].prompt[: len(eval_set[7].prompt) * 3 // 4], answer="x"),
    ]
    kept, rep = find_contamination(train + leaked, eval_set, ContaminationConfig(n=8, min_overlap=0.5))
    assert set(rep.flagged) == {"leak0", "leak1"}
    assert rep.flagged["leak0"]["eval_ids"] == ["ev3"] and rep.flagged["leak1"]["eval_ids"] == ["ev7"]
    assert len(kept) == 50


def test_length_filter_with_a_tokenizer():
    def tokenize(text: str) -> list[int]:
        return [ord(c) for c in text]

    recs = [Record(id=str(i), prompt="x" * i, answer="y" * (10 - i)) for i in range(1, 10)]
    kept, rep = filter_by_length(recs, tokenize, max_prompt_tokens=6, max_answer_tokens=6)
    assert [r.id for r in kept] == ["4", "5", "6"]
    assert rep.too_long_prompt == ["7", "8", "9"] and rep.too_long_answer == ["1", "2", "3"]
    assert rep.prompt_tokens["max"] == 9


class NoisySampler:
    """A stand-in for a tiny model: prompt p is answered right with probability q(p)
    (a hash of the prompt), each sample decided by a seeded draw. Deterministic, so the
    test can recount exactly what the pre-filter saw."""

    def __init__(self, answers: dict[str, str], seed: int = 0) -> None:
        self.answers = answers
        self.seed = seed
        self.calls = 0

    def prob(self, prompt: str) -> float:
        h = hashlib.sha256(f"{self.seed}|{prompt}".encode()).digest()
        return [0.0, 1.0, int.from_bytes(h[:4], "little") / 2**32][h[4] % 3]

    def __call__(self, prompts, n):
        self.calls += 1
        out = []
        for p in prompts:
            q = self.prob(p)
            row = []
            for j in range(n):
                right = random.Random(f"{self.seed}|{p}|{j}").random() < q
                row.append(self.answers[p] if right else self.answers[p] + "7")
            out.append(row)
        return out


@pytest.mark.parametrize(("lower", "upper"), [(0.0, 1.0), (0.25, 0.75)])
def test_pass_rate_prefilter_keeps_strictly_between_bounds(tmp_path, lower, upper):
    task = ArithmeticTask()
    recs = task.generate(120, seed=4)
    sampler = NoisySampler({r.prompt: r.answer for r in recs})
    cfg = PassRateConfig(n=8, lower=lower, upper=upper, batch_size=50)
    out, rep_path = tmp_path / "curated.jsonl", tmp_path / "report.json"
    kept, rep = prefilter_by_pass_rate(
        recs, sampler, task.verifier(), cfg, out_path=out, report_path=rep_path
    )
    assert sampler.calls == 3  # 120 prompts in batches of 50
    # Recount: draw the same samples again and count correct answers by hand.
    samples = sampler([r.prompt for r in recs], 8)
    rates = {r.id: sum(s == r.answer for s in row) / 8 for r, row in zip(recs, samples)}
    expected = [r.id for r in recs if lower < rates[r.id] < upper]
    assert [r.id for r in kept] == expected
    assert 0 < len(expected) < len(recs)
    assert all(lower < r.metadata["pass_rate"] < upper for r in kept)
    assert [r.id for r in load_jsonl(out)] == expected
    saved = json.loads(rep_path.read_text())
    assert saved["pass_rates"] == rates and saved["kept"] == len(expected)
    assert saved["too_hard"] == sum(v <= lower for v in rates.values())
    assert saved["too_easy"] == sum(v >= upper for v in rates.values())
    assert sum(saved["histogram"].values()) == 120
    buckets = difficulty_buckets(kept)
    assert list(buckets)[0] == "[0.75, 1.00]" and list(buckets)[-1] == "[0.00, 0.25)"
    assert sum(len(b) for b in buckets.values()) == len(kept)
    for name, members in buckets.items():
        lo, hi = (float(x) for x in name.strip("[])").split(","))
        assert all(lo <= r.metadata["pass_rate"] <= hi for r in members)
    sources = bucket_sources(buckets, {"[0.75, 1.00]": 3.0}, epochs=1)
    assert [s.name for s in sources] == [n for n, b in buckets.items() if b]
    streamed = [r.id for r in PromptStream(sources, seed=0)]
    assert sorted(streamed) == sorted(r.id for r in kept)


def test_prefilter_config_and_buckets_validate():
    with pytest.raises(ValueError, match="lower"):
        PassRateConfig(lower=0.5, upper=0.5)
    with pytest.raises(ValueError, match="pass_rate"):
        difficulty_buckets(CountdownTask().generate(1, seed=0))
    with pytest.raises(ValueError, match="edges"):
        difficulty_buckets([], edges=(0.5, 0.2))


def test_rich_summary():
    recs = ArithmeticTask().generate(30, seed=0)
    _, d = deduplicate(recs + recs[:3])
    with open(os.devnull, "w") as sink:
        text = render_summary({"dedup": d}, console=Console(file=sink, width=100))
    assert "dedup" in text and "33" in text and "30" in text


BOARD = (
    "Alice picks the number 12 and Bob picks the number 5, and they write both numbers on the board "
    "in the classroom for everyone to see. What is the {} written on the board?"
)
# Pairs that look alike but ask different things: every one must survive both passes.
DIFFERENT_PROBLEMS = [
    ("808-414=", "808+414="),
    ("12*3=", "12/3="),
    ("3.5*2=", "35*2="),
    ("2*(3+4)=", "2*3+4="),
    ("Is 7 < 9?", "Is 7 > 9?"),
    ("What is 5!?", "What is 5?"),  # a factorial, not an exclamation
    ("Compute 10!/8!.", "Compute 10/8."),
    ("If f(x)=x^3, find f'(2).", "If f(x)=x^3, find f(2)."),  # a derivative, not a quote
    ("Simplify x^2 * x^3.", "Simplify x^2 * x^4."),
    ("Solve for x: 3x+5=11", "Solve for x: 3x+5=17"),
    ("Solve for x: 2x+3=7", "Solve for y: 2y+3=7"),
    ("9,8,2>15:", "9,8,2>17:"),
    (
        "Using the numbers 3, 5 and 7 once each with + - * and /, write an expression equal to 15.",
        "Using the numbers 3, 5 and 7 once each with + - * and /, write an expression equal to 16.",
    ),
    (
        "A farmer has 12 cows in the field and then buys 5 more at the market. How many cows does the "
        "farmer have now in total?",
        "A farmer has 12 cows in the field and then buys 7 more at the market. How many cows does the "
        "farmer have now in total?",
    ),
    # One word of many names the operation, comparison, count or negation.
    (
        BOARD.format("larger of the two numbers"),
        BOARD.format("smaller of the two numbers"),
    ),
    (BOARD.format("sum of the two numbers"), BOARD.format("product of the two numbers")),
    (BOARD.format("sum of three such numbers"), BOARD.format("sum of four such numbers")),
    (
        r"Evaluate the expression \sqrt{16} exactly and write the result as a single whole number.",
        r"Evaluate the expression \log{16} exactly and write the result as a single whole number.",
    ),
    (
        "Find the derivative of sin(x) with respect to x, showing every step of the working clearly "
        "and simplifying the final expression as far as it goes.",
        "Find the derivative of cos(x) with respect to x, showing every step of the working clearly "
        "and simplifying the final expression as far as it goes.",
    ),
    (
        "Show with trial division by the small primes, step by step, that the number 91 is prime.",
        "Show with trial division by the small primes, step by step, that the number 91 is not prime.",
    ),
]


@pytest.mark.parametrize("near", [False, True])
def test_dedup_keeps_problems_that_differ_in_what_decides_the_answer(near):
    recs = [
        Record(id=f"{i}{side}", prompt=text, answer="?")
        for i, pair in enumerate(DIFFERENT_PROBLEMS)
        for side, text in zip("ab", pair)
    ]
    kept, rep = deduplicate(recs, DedupConfig(threshold=0.5, near=near))
    assert rep.removed == [] and len(kept) == len(recs), rep


def test_countdown_prompts_with_another_target_are_not_duplicates():
    base = CountdownTask().generate(60, seed=3)
    retargeted = [
        Record(
            id=r.id + "-t",
            prompt=r.prompt.replace(f">{r.metadata['target']}:", f">{r.metadata['target'] + 1}:"),
            answer="x",
        )
        for r in base
    ]
    assert all(a.prompt != b.prompt for a, b in zip(base, retargeted))
    ids = [r.id for r in base + retargeted]
    assert len(set(ids)) == len(ids)
    unique_prompts = {r.prompt for r in base + retargeted}
    kept, rep = deduplicate(base + retargeted, DedupConfig(threshold=0.5))
    # Only repeats of one exact prompt (the generator may draw a task twice) may go.
    assert len(kept) == len(unique_prompts) and rep.near_pairs == []


def test_dedup_still_merges_the_same_problem_written_differently():
    recs = [
        Record(id="a", prompt="What is 808-414?", answer="394"),
        Record(id="b", prompt="what is 808 - 414", answer="394"),  # case, spacing, punctuation
        Record(
            id="c", prompt="Solve for x: 3x+5=11. Give the value of x as a whole number please.", answer="2"
        ),
        Record(
            id="d",
            prompt="Solve for x; 3x + 5 = 11. Give the value of x as a whole number please, thanks!",
            answer="2",
        ),
    ]
    kept, rep = deduplicate(recs, DedupConfig(threshold=0.5))
    assert [r.id for r in kept] == ["a", "c"]
    assert rep.exact_groups == [["a", "b"]]
    assert [(a, b) for a, b, _ in rep.near_pairs] == [("c", "d")]


LONG_EVAL = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)


def test_contamination_finds_an_eval_problem_inside_a_long_training_text():
    rng = random.Random(5)
    eval_set = [Record(id="gsm", prompt=LONG_EVAL, answer="72")] + [
        Record(id=f"ev{i}", prompt=_sentence(rng, 30), answer="x") for i in range(5)
    ]
    embedded = Record(
        id="embedded",
        prompt=_sentence(rng, 150) + " " + LONG_EVAL.upper() + " " + _sentence(rng, 150),
        answer="x",
    )
    # Shares one 13-gram with the problem, far from all of it: not a leak.
    one_gram = Record(
        id="one_gram", prompt=" ".join(LONG_EVAL.split()[:13]) + " " + _sentence(rng, 40), answer="x"
    )
    clean = [Record(id=f"t{i}", prompt=_sentence(rng, 200), answer="x") for i in range(10)]
    kept, rep = find_contamination(clean + [embedded, one_gram], eval_set)
    assert set(rep.flagged) == {"embedded"}
    assert rep.flagged["embedded"] == {"overlap": 1.0, "eval_ids": ["gsm"]}
    assert [r.id for r in kept] == [r.id for r in clean] + ["one_gram"]


def test_contamination_of_questions_shorter_than_n_words():
    eval_set = [
        Record(id="sub", prompt="What is 808-414?", answer="394"),
        Record(id="cd", prompt="9,8,2>15:", answer="9+8-2"),
        Record(
            id="twelve", prompt="How many positive divisors does the number 36 have in total?", answer="9"
        ),
    ]
    train = [
        Record(id="has_sub", prompt="Warm-up. WHAT IS 808 - 414 ? Then explain your steps.", answer="x"),
        Record(id="has_cd", prompt="Solve this countdown: 9,8,2>15: using each number once", answer="x"),
        Record(
            id="has_twelve",
            prompt="Q: how many positive divisors does the number 36 have in total",
            answer="x",
        ),
        Record(id="other_op", prompt="What is 808+414?", answer="x"),
        Record(id="other_number", prompt="What is 1808-414?", answer="x"),
        Record(id="other_target", prompt="9,8,2>17:", answer="x"),
        Record(id="other_numbers", prompt="9,8,3>15:", answer="x"),
        Record(
            id="part_only", prompt="How many positive divisors does the number 48 have in total?", answer="x"
        ),
    ]
    kept, rep = find_contamination(train, eval_set)
    assert {k: v["eval_ids"] for k, v in rep.flagged.items()} == {
        "has_sub": ["sub"],
        "has_cd": ["cd"],
        "has_twelve": ["twelve"],
    }
    assert [r.id for r in kept] == ["other_op", "other_number", "other_target", "other_numbers", "part_only"]
