"""Where a run's CPU goes: each process's cores (user + system time over wall time) between two
training steps of one `rlax launch`, with the machine's busy share and the step's parts.

    python tools/run_cpu_use.py [--from-step 20] [--to-step 100] [--json F] -- \\
        configs/demo.yaml run.steps=100 [key=value ...]

It launches the run (`rlax launch ARGS run.output_dir=<temporary folder>`), reads every
descendant process's CPU time from /proc twice a second, and once the run has ended prints,
for the window between the train records of `--from-step` and `--to-step`, each process's
cores and the mean per step of the trainer's and workers' parts from metrics.jsonl. On the
2-core development machine this showed why a synchronous demo step leaves a third of the
machine idle and how much of it asynchrony could fill (docs/benchmarks.md, "Where a demo
step's CPU goes"). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from rlax_controller.metrics import read_metrics
from rlax_protocol.atomic_files import atomic_write_bytes

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
STEP_PARTS = ("step_time_s", "train_seconds", "trainer_wait_seconds", "worker_active_s", "worker_reload_s",
              "trainer_push_seconds", "controller_snapshot_seconds")  # fmt: skip


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces


def descendants(root: int) -> list[int]:
    """`root` and every process below it."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += parents.get(pid, [])
    return found


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` so far (None once it has gone)."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def machine_seconds() -> tuple[float, float]:
    """(all CPU seconds, idle + iowait CPU seconds) of the machine since boot."""
    values = [int(v) for v in pathlib.Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values) / TICKS_PER_S, (values[3] + values[4]) / TICKS_PER_S


def role_of(pid: int) -> str:
    try:
        words = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return "?"
    if "rlax_core.cli" in words:  # python -m rlax_core.cli ROLE ... [--index I]
        role = words[words.index("rlax_core.cli") + 1]
        return f"{role}{words[words.index('--index') + 1]}" if "--index" in words else role
    return "paramserver" if "rlax_paramserver" in words else os.path.basename(words[0]) or "?"


def sample(process: subprocess.Popen[bytes], period_s: float) -> list[dict[str, Any]]:
    """Samples of (time, machine CPU seconds, {pid: (role, CPU seconds)}) until `process` ends."""
    samples = []
    while process.poll() is None:
        per_process = {}
        for pid in descendants(process.pid):
            if (seconds := cpu_seconds(pid)) is not None:
                per_process[pid] = (role_of(pid), seconds)
        samples.append({"time": time.time(), "machine": machine_seconds(), "processes": per_process})
        time.sleep(period_s)
    return samples


def summarise(
    samples: list[dict[str, Any]], records: list[dict[str, Any]], first: int, last: int
) -> dict[str, Any]:
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    if first not in train or last not in train or last <= first:
        raise SystemExit(f"the run has no train records for steps {first} and {last} (it has {len(train)})")
    start = min(samples, key=lambda s: abs(s["time"] - train[first]["time"]))
    end = min(samples, key=lambda s: abs(s["time"] - train[last]["time"]))
    wall = end["time"] - start["time"]
    total, idle = (b - a for a, b in zip(start["machine"], end["machine"], strict=True))
    cores: dict[str, float] = {}
    for pid, (role, seconds) in end["processes"].items():
        before = start["processes"].get(pid, (role, 0.0))[1]  # a process started later: nothing before
        cores[role] = cores.get(role, 0.0) + (seconds - before) / wall
    steps = [train[s] for s in range(first + 1, last + 1) if s in train]
    parts = {k: sum(r.get(k, 0.0) for r in steps) / len(steps) for k in STEP_PARTS}
    return {"steps": [first, last], "wall_s": wall, "machine_busy": 1 - idle / total,
            "machine_cores": os.cpu_count(), "cores": cores, "per_step": parts}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-step", type=int, default=20)
    parser.add_argument("--to-step", type=int, default=100)
    parser.add_argument("--period", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--json", type=pathlib.Path, help="also write the summary here")
    parser.add_argument("launch_args", nargs="+", help="`rlax launch` arguments: a config and overrides")
    args = parser.parse_args(argv)
    out = pathlib.Path(tempfile.mkdtemp(prefix="rlax-cpu-use-"))
    try:
        command = ["rlax", "launch", *args.launch_args, f"run.output_dir={out}"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples = sample(process, args.period)
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited {process.returncode} (logs in {out}/logs)")
        summary = summarise(samples, read_metrics(out / "metrics.jsonl"), args.from_step, args.to_step)
    except BaseException:
        print(f"run folder kept: {out}", file=sys.stderr)
        raise
    shutil.rmtree(out, ignore_errors=True)
    print(f"steps {args.from_step}-{args.to_step}: {summary['wall_s']:.2f} s, the machine "
          f"{summary['machine_busy']:.0%} busy ({summary['machine_cores']} cores)")  # fmt: skip
    for role, used in sorted(summary["cores"].items(), key=lambda kv: -kv[1]):
        print(f"  {role:<12} {used:5.2f} cores")
    for part, seconds in summary["per_step"].items():
        print(f"  {part:<28} {seconds * 1e3:7.1f} ms a step")
    if args.json:
        atomic_write_bytes(args.json, json.dumps(summary, indent=1).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
