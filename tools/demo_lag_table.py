"""The demo at several pinned lags, with and without the off-policy correction, over
several seeds: eval pass@1 at every evaluation and the steps to the reward target, as the
Markdown table in docs/benchmarks.md ("Lag and off-policy correction").

    python tools/demo_lag_table.py [--lags 0 1 2 4] [--seeds 0 1 2] [--jobs 2] [--json F]

Each cell is one `rlax launch configs/demo.yaml run.seed=S controller.lag=L trainer.k=L`
(`paramserver.keep` raised to L + 1 where its default holds too few versions; with the
correction, `trainer.objective.importance.correction={kind: tis, upper: 2.0}`: decoupled
PPO's behaviour weight truncated at 2). Pinned versions make every run a
function of its config and seed, so `--jobs 2` (two runs side by side) changes the time,
never the figures.

The reward target: the training reward's moving average over `--window` steps reaches
`--target`; "steps to target" is the first step where it does (or "-" if none).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from demo_seeds import ROOT, launch_demo

CORRECTIONS = {
    "none": [],
    "tis 2": ["trainer.objective.importance.correction={kind: tis, upper: 2.0}"],
}


def launch(out: pathlib.Path, overrides: list[str], timeout_s: float) -> list[dict[str, Any]]:
    """One `rlax launch` of the demo; its metrics records."""
    return launch_demo(ROOT / "configs" / "demo.yaml", out, overrides, timeout_s=timeout_s)


def steps_to_target(records: list[dict[str, Any]], target: float, window: int) -> int | None:
    train = {int(r["step"]): float(r["reward_mean"]) for r in records if r.get("kind") == "train"}
    rewards = [train[s] for s in sorted(train)]
    for i in range(window - 1, len(rewards)):
        if statistics.mean(rewards[i - window + 1 : i + 1]) >= target:
            return sorted(train)[i]
    return None


def summarise(records: list[dict[str, Any]], target: float, window: int) -> dict[str, Any]:
    evals: dict[int, float] = {}
    for r in records:
        if r.get("kind") == "eval":
            evals.setdefault(int(r["step"]), float(r["pass@1"]))  # the end-of-run repeat is dropped
    return {"pass@1": evals, "steps_to_target": steps_to_target(records, target, window)}


def cell(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS))
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side")
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--out", default="runs/demo-lags")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--json", default="", help="write every run's figures here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()

    settings = [(lag, c) for lag in args.lags for c in args.corrections]
    jobs = {
        (lag, c, seed): [
            f"run.seed={seed}",
            f"controller.lag={lag}",
            f"paramserver.keep={max(4, lag + 1)}",
            f"trainer.k={lag}",
            *CORRECTIONS[c],
            *args.overrides,
        ]  # fmt: skip
        for lag, c in settings
        for seed in args.seeds
    }
    results: dict[tuple[int, str, int], dict[str, Any]] = {}
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = {
            pool.submit(
                launch,
                pathlib.Path(args.out) / f"lag{lag}-{c.replace(' ', '')}-seed{seed}",
                overrides,
                args.timeout_s,
            ): (lag, c, seed)
            for (lag, c, seed), overrides in jobs.items()
        }
        for future in concurrent.futures.as_completed(futures):
            key = futures[future]
            results[key] = summarise(future.result(), args.target, args.window)
            print(f"lag {key[0]} correction {key[1]} seed {key[2]}: {results[key]} "
                  f"({time.monotonic() - started:.0f}s)", flush=True)  # fmt: skip

    eval_steps = sorted(set.intersection(*(set(r["pass@1"]) for r in results.values())))
    shown = [s for s in eval_steps if s > 0]
    head = ["lag", "correction", "pass@1 step 0", *(f"step {s}" for s in shown), "steps to target"]
    print(f"\nSeeds {args.seeds}; mean ± spread (population std) over seeds; target: the "
          f"{args.window}-step moving average of the training reward reaches {args.target}.\n")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for lag, c in settings:
        runs = [results[(lag, c, s)] for s in args.seeds]
        reached = [r["steps_to_target"] for r in runs]
        to_target = cell([float(x) for x in reached]) if all(x is not None for x in reached) else f"{reached}"
        row = [str(lag), c, *(cell([r["pass@1"][s] for r in runs]) for s in [0, *shown]), to_target]
        print("| " + " | ".join(row) + " |")
    if args.json:
        out = {f"lag{k[0]}|{k[1]}|seed{k[2]}": v for k, v in results.items()}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
