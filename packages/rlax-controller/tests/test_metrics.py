from __future__ import annotations

import io
import pathlib
import subprocess
import sys

import pytest
from rich.console import Console

from rlax_controller.metrics import (
    MetricsWriter,
    ProgressDisplay,
    generation_record,
    latest_per_step,
    moving_average,
    plot_run,
    read_metrics,
    summary_rows,
    summary_table,
    trajectory_record,
)
from rlax_protocol.messages import Sample, WorkerStats


def fill(writer: MetricsWriter) -> None:
    for step in range(1, 6):
        writer.write(
            {
                "kind": "train",
                "step": step,
                "reward_mean": 0.1 * step,
                "pass_rate": 0.1 * step,
                "staleness_max": 1,
                "logprob_delta_p50": 1e-4,
                "logprob_delta_p95": 2e-4,
                "logprob_delta_max": 5e-4,
            }
        )
    writer.write({"kind": "eval", "step": 0, "pass@1": 0.10, "pass@8": 0.30, "reward_mean": 0.1})
    writer.write({"kind": "eval", "step": 5, "pass@1": 0.40, "pass@8": 0.75, "reward_mean": 0.4})


def test_writer_jsonl_tensorboard_and_reader(tmp_path: pathlib.Path) -> None:
    writer = MetricsWriter(tmp_path)
    fill(writer)
    writer.write({"kind": "train", "step": 5, "reward_mean": 0.55})  # a restarted writer repeats a step
    writer.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == 8
    train = latest_per_step(read_metrics(tmp_path / "metrics.jsonl", kind="train"))
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5] and train[-1]["reward_mean"] == 0.55
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(ValueError, match="kind"):
        MetricsWriter(tmp_path / "x", tensorboard=False).write({"step": 1})


def test_the_tensorboard_writer_does_not_load_torch(tmp_path: pathlib.Path) -> None:
    # tensorboardX imports torch whenever it is installed (~240 MB of the controller's memory).
    script = (
        "import importlib.util, pathlib, sys\n"
        "from rlax_controller.metrics import MetricsWriter\n"
        f"w = MetricsWriter({str(tmp_path)!r})\n"
        "w.write({'kind': 'train', 'step': 3, 'reward_mean': 0.25})\n"
        "w.close()\n"
        "print(importlib.util.find_spec('torch') is not None, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    installed, loaded = done.stdout.split()
    assert installed == "True", "torch is not installed here: this test would prove nothing"
    assert loaded == "False"
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    assert b"train/reward_mean" in events.read_bytes()


def test_reader_tolerates_torn_last_line_only(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "train", "step": 1}\n{"kind": "tr')
    assert len(read_metrics(path)) == 1
    path.write_text('{"kind": "train", "step": 1}\nnot json\n{"kind": "train", "step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        read_metrics(path)


def test_summary_and_plot(tmp_path: pathlib.Path) -> None:
    writer = MetricsWriter(tmp_path, tensorboard=False)
    fill(writer)
    records = read_metrics(writer.path)
    rows = {r[0]: r for r in summary_rows(records)}
    assert rows["eval pass@8 (step 0 -> 5)"][3] == "+45.0 pts"
    out = io.StringIO()
    Console(file=out, width=120).print(summary_table(records))
    assert "pass@8" in out.getvalue()
    png = plot_run(records, tmp_path / "plot.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_moving_average_of_the_last_window_skips_missing_values() -> None:
    nan = float("nan")
    averaged = moving_average([1.0, 2.0, 3.0, 4.0, nan, 6.0, nan, nan, nan], window=3)
    # By hand: [1], [1,2], [1,2,3], [2,3,4], [3,4], [4,6], [6], [6], [] (none finite).
    assert averaged[:8] == [1.0, 1.5, 2.0, 3.0, 3.5, 5.0, 6.0, 6.0]
    assert averaged[8] != averaged[8]  # NaN


def test_progress_plain_lines_when_not_a_tty() -> None:
    out = io.StringIO()
    display = ProgressDisplay(10, stream=out)
    display.update({"kind": "train", "step": 3, "reward_mean": 0.5, "queue_depth": 2})
    display.update({"kind": "eval", "step": 3, "pass@8": 0.6})
    display.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[train] step=3/10") and "reward=0.500" in lines[0] and "queue=2" in lines[0]
    assert lines[1] == "[eval] step=3 pass@8=0.600"


def test_progress_live_table_on_a_terminal() -> None:
    out = io.StringIO()
    display = ProgressDisplay(10, stream=out, live=True)
    display.update({"kind": "train", "step": 4, "reward_mean": 0.25})
    display.close()
    assert "step 4/10" in out.getvalue() and "0.250" in out.getvalue()


def test_generation_record_differences_worker_totals_and_survives_a_restart() -> None:
    before = {
        "worker0": WorkerStats(
            generated_tokens=1000, active_s=10.0, engine_s=8.0, compile_s=30.0, reload_s=1.0
        ),
        "worker1": WorkerStats(generated_tokens=500, active_s=20.0, engine_s=15.0, compile_s=30.0),
    }
    after = {
        # 600 tokens in 4 busy seconds (3 in engine steps), 0.5 s reloading
        "worker0": WorkerStats(
            generated_tokens=1600, active_s=14.0, engine_s=11.0, compile_s=30.0, reload_s=1.5
        ),
        # restarted: totals went down, so they count from zero (200 tokens, 1 s, 5 s compiling)
        "worker1": WorkerStats(generated_tokens=200, active_s=1.0, engine_s=1.0, compile_s=5.0),
        "worker2": None,  # no result yet
    }
    record = generation_record(before, after)
    assert record["worker_gen_tokens_per_s"] == pytest.approx(800 / 5.0)
    assert record["worker_engine_tokens_per_s"] == pytest.approx(800 / 4.0)
    assert record["worker_compile_s"] == pytest.approx(5.0)
    assert record["worker_reload_s"] == pytest.approx(0.5)
    assert generation_record(after, after) == {}  # nothing generated in between: no rate


def test_summary_shows_the_median_step_and_its_parts() -> None:
    records = [
        {"kind": "train", "step": s, "step_time_s": t, "train_seconds": 0.1, "trainer_wait_seconds": w}
        for s, t, w in ((1, 9.0, 8.0), (2, 0.3, 0.12), (3, 0.2, 0.08), (4, 0.25, 0.1))
    ]
    rows = {r[0]: r for r in summary_rows(records)}
    # The first step (compilations) is the start column; the median leaves it out of the end.
    assert rows["train step_time_s (median)"][1:3] == ("9.000", "0.275")
    assert rows["train trainer_wait_seconds (median)"][1:3] == ("8.000", "0.110")
    assert rows["train train_seconds (median)"][2] == "0.100"
    assert "train trainer_push_seconds (median)" not in rows  # a part no record carries


def trajectory(tool_calls: int, tool_errors: int = 0, tool_correct: bool | None = None) -> Sample:
    return Sample(
        token_ids=(3, 4),
        logprobs=(),
        finish_reason="stop",
        turns=1 + tool_calls,
        tool_calls=tool_calls,
        tool_errors=tool_errors,
        end="answer",
        tool_correct=tool_correct,
    )


def test_tool_ok_rate_counts_correct_use_where_the_environment_judged_it() -> None:
    samples = [
        trajectory(1, tool_correct=True),  # the right call, its result used
        trajectory(1, tool_correct=False),  # a call that ran but asked or copied wrong
        trajectory(2, tool_errors=1, tool_correct=True),  # a failed call, then a right one
        trajectory(0, tool_correct=False),  # no call
    ]
    record = trajectory_record(samples)
    assert record["tool_use_rate"] == 3 / 4
    # "Called, and no call failed" says nothing of the question asked: 2 of 4 here.
    assert record["tool_no_error_rate"] == 2 / 4
    assert record["tool_ok_rate"] == 2 / 4
    # Only judged trajectories count: one whose environment could not tell is left out.
    assert trajectory_record([*samples, trajectory(1)])["tool_ok_rate"] == 2 / 4


def test_without_a_judging_environment_there_is_no_tool_ok_rate() -> None:
    record = trajectory_record([trajectory(1), trajectory(1, tool_errors=1), trajectory(0)])
    assert "tool_ok_rate" not in record
    assert (record["tool_use_rate"], record["tool_no_error_rate"]) == (2 / 3, 1 / 3)
    single = Sample(token_ids=(3,), logprobs=(), finish_reason="stop")
    assert trajectory_record([single]) == {}


def test_summary_shows_both_tool_figures() -> None:
    records = [
        {"kind": "train", "step": s, "tool_use_rate": 0.5, "tool_ok_rate": 0.1 * s, "tool_no_error_rate": 0.4}
        for s in (1, 2)
    ] + [
        {"kind": "eval", "step": s, "pass@1": 0.1, "tool_ok_rate": 0.2 * s, "tool_no_error_rate": 0.5}
        for s in (0, 2)
    ]
    rows = {r[0]: r[1:] for r in summary_rows(records)}
    assert rows["train tool_ok_rate"] == ("0.100", "0.200", "+0.100")
    assert rows["train tool_no_error_rate"] == ("0.400", "0.400", "+0.000")
    assert rows["eval tool_ok_rate (step 0 -> 2)"] == ("0.000", "0.400", "+40.0 pts")
    assert "eval tool_no_error_rate (step 0 -> 2)" in rows
