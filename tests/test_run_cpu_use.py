"""tools/run_cpu_use.py: the /proc readings on real processes, and the summary's arithmetic."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import pytest

TOOL = pathlib.Path(__file__).resolve().parent.parent / "tools" / "run_cpu_use.py"
spec = importlib.util.spec_from_file_location("run_cpu_use", TOOL)
assert spec is not None and spec.loader is not None
run_cpu_use = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_cpu_use)

BUSY = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(30)\n"


def test_a_busy_child_is_found_below_its_parent_with_its_cpu_time_and_role() -> None:
    # argv as the launcher starts a worker: `python -m rlax_core.cli worker --config F --index 1`
    child = subprocess.Popen([sys.executable, "-c", BUSY, "rlax_core.cli", "worker", "--index", "1"])
    try:
        deadline = time.monotonic() + 30
        while (seconds := run_cpu_use.cpu_seconds(child.pid)) is None or seconds < 0.3:
            assert time.monotonic() < deadline, f"the child's CPU time stayed at {seconds}"
            time.sleep(0.05)
        assert child.pid in run_cpu_use.descendants(os.getpid())
        assert os.getpid() not in run_cpu_use.descendants(child.pid)
        assert run_cpu_use.role_of(child.pid) == "worker1"
    finally:
        child.kill()
        child.wait()
    assert run_cpu_use.cpu_seconds(child.pid) is None  # gone


def test_the_summary_counts_each_role_over_the_window_only() -> None:
    def at(t: float, machine: tuple[float, float], processes: dict[int, tuple[str, float]]) -> dict:
        return {"time": t, "machine": machine, "processes": processes}

    samples = [
        at(100.0, (1000.0, 900.0), {1: ("trainer", 5.0)}),
        at(110.0, (1020.0, 905.0), {1: ("trainer", 15.0), 2: ("worker0", 1.0), 3: ("worker1", 2.0)}),
        # worker2 started inside the window (a restart): all its CPU time counts
        at(
            120.0,
            (1040.0, 911.0),
            {1: ("trainer", 20.0), 2: ("worker0", 4.0), 3: ("worker1", 3.0), 4: ("worker2", 2.0)},
        ),
    ]
    records = [
        {"kind": "train", "step": 1, "time": 109.9, "step_time_s": 1.0},
        {"kind": "train", "step": 2, "time": 115.0, "step_time_s": 2.0, "train_seconds": 0.5},
        {"kind": "eval", "step": 2, "time": 116.0},
        {"kind": "train", "step": 3, "time": 120.2, "step_time_s": 4.0, "train_seconds": 1.5},
    ]
    summary = run_cpu_use.summarise(samples, records, first=1, last=3)
    assert summary["wall_s"] == pytest.approx(10.0)
    assert summary["machine_busy"] == pytest.approx(1 - 6.0 / 20.0)
    assert summary["cores"] == pytest.approx({"trainer": 0.5, "worker0": 0.3, "worker1": 0.1, "worker2": 0.2})
    assert summary["per_step"]["step_time_s"] == pytest.approx(3.0)  # steps 2 and 3
    assert summary["per_step"]["train_seconds"] == pytest.approx(1.0)
    with pytest.raises(SystemExit, match="no train records for steps 1 and 9"):
        run_cpu_use.summarise(samples, records, first=1, last=9)
