"""The demo over several seeds: eval pass@1 (and pass@8) at every evaluation step, with
the mean and spread across seeds.

    python tools/demo_seeds.py --seeds 0 1 2 [--out DIR] [--config configs/demo.yaml] [key=value ...]

Each seed is one `rlax launch CONFIG run.seed=S` (sequential, so the runs do not share the
CPU); multi-turn runs (`configs/multiturn-demo.yaml`) report their tool use too. `--cli-module` and `--pythonpath` run another checkout's launcher
(e.g. an older commit in a git worktree) with the same interpreter, for a side-by-side
comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def launch_demo(
    config: pathlib.Path,
    out: pathlib.Path,
    overrides: list[str],
    *,
    timeout_s: float,
    cli_module: str = "rlax_core.cli",
    pythonpath: str = "",
) -> list[dict[str, Any]]:
    """One `rlax launch --overwrite config` into `out`; the run's metrics records."""
    cmd = [
        sys.executable, "-m", cli_module, "launch", "--overwrite", str(config), f"run.output_dir={out}",
        *overrides,
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"{out}: rlax launch exited {result.returncode}:\n{result.stdout[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# Evaluation figures collected per step: pass@k, and the tool use of multi-turn runs.
EVAL_KEYS = ("pass@", "tool_use_rate", "tool_ok_rate", "tool_no_error_rate")


def run_seed(args: argparse.Namespace, seed: int, out: pathlib.Path) -> dict[int, dict[str, float]]:
    config = pathlib.Path(args.root) / args.config
    started = time.monotonic()
    records = launch_demo(
        config, out, [f"run.seed={seed}", *args.overrides], timeout_s=args.timeout_s,
        cli_module=args.cli_module, pythonpath=args.pythonpath,
    )  # fmt: skip
    evals: dict[int, dict[str, float]] = {}
    for record in records:
        if record.get("kind") == "eval":
            evals[int(record["step"])] = {k: float(v) for k, v in record.items() if k.startswith(EVAL_KEYS)}
    print(f"seed {seed}: {time.monotonic() - started:.0f}s, eval steps {sorted(evals)}", flush=True)
    return evals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="runs/demo-seeds")
    parser.add_argument("--root", default=str(ROOT), help="checkout whose config runs")
    parser.add_argument("--config", default="configs/demo.yaml", help="the config, relative to --root")
    parser.add_argument("--cli-module", default="rlax_core.cli")
    parser.add_argument("--pythonpath", default="")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("--json", default="", help="write the per-seed figures here")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    per_seed = {s: run_seed(args, s, pathlib.Path(args.out) / f"seed{s}") for s in args.seeds}
    steps = sorted(set.intersection(*(set(e) for e in per_seed.values())))
    metrics = sorted({k for e in per_seed.values() for v in e.values() for k in v})
    print(f"\n{'step':>5} " + " ".join(f"{m:>24}" for m in metrics))
    for step in steps:
        cells = []
        for m in metrics:
            values = [per_seed[s][step][m] for s in args.seeds]
            spread = statistics.pstdev(values)
            cells.append(
                f"{statistics.mean(values):.3f} ± {spread:.3f} ({min(values):.2f}-{max(values):.2f})"
            )
        print(f"{step:>5} " + " ".join(f"{c:>24}" for c in cells))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({str(s): e for s, e in per_seed.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
