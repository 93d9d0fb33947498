"""Run metrics: JSONL + TensorBoard writer, live progress display, summary table and plot.

Every record is a flat dict with a `kind` (``train``, ``eval``, ``worker``, ``event``) and
a `step`. Records go to `metrics.jsonl` (one JSON object per line, appended in one write
call, so a record survives a SIGKILL of the writer; not fsynced: see `rlax_core.fsutil`)
and numeric fields to TensorBoard as ``kind/field``.
"""

from __future__ import annotations

import json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from rlax_core.fsutil import append_line

__all__ = [
    "format_number",
    "MetricsWriter",
    "generation_record",
    "ProgressDisplay",
    "latest_per_step",
    "plot_run",
    "read_metrics",
    "summary_rows",
    "summary_table",
    "trajectory_record",
]


def _summary_writer_class() -> Any:
    """tensorboardX's `SummaryWriter`, imported without torch.

    tensorboardX imports torch whenever it is installed, only to accept torch tensors; in
    the controller (which writes floats) that was ~240 MB of its ~290 MB resident memory
    on the SmolLM2 job. `sys.modules["torch"] = None` makes that one `import torch` fail
    as if torch were absent; nothing else is imported meanwhile (the controller builds
    its writer before any thread starts), and a process that already has torch keeps it.
    """
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends metric records to `folder/metrics.jsonl` and to TensorBoard event files."""

    def __init__(self, folder: str | pathlib.Path, *, tensorboard: bool = True) -> None:
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.jsonl"
        self._tb: Any = None
        if tensorboard:
            self._tb = _summary_writer_class()(logdir=str(self.folder / "tensorboard"), flush_secs=5)

    def write(self, record: dict[str, Any]) -> None:
        if "kind" not in record or "step" not in record:
            raise ValueError(f"a metrics record needs `kind` and `step`, got keys {sorted(record)}")
        record = {"time": time.time(), **record}
        append_line(self.path, json.dumps(record, allow_nan=True))
        if self._tb is not None:
            step = int(record["step"])
            for key, value in record.items():
                if key in ("time", "step") or isinstance(value, bool):
                    continue
                if isinstance(value, int | float) and math.isfinite(value):
                    # TensorBoard tag names allow no "@": pass@8 -> pass_at_8.
                    self._tb.add_scalar(f"{record['kind']}/{key.replace('@', '_at_')}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(path: str | pathlib.Path, kind: str | None = None) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (of one `kind` when given); a torn last line is ignored,
    any other bad line raises an error naming the file and line."""
    path = pathlib.Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if number == len(lines):
                break  # the writer was killed mid-line
            raise ValueError(f"{path}:{number}: not a JSON metrics record ({error})") from None
        if kind is None or record.get("kind") == kind:
            records.append(record)
    return records


def latest_per_step(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step (the last written), sorted by step: a restarted writer may repeat a step."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def generation_record(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Generation figures between two readings of every worker's `WorkerStats` totals.

    before/after: worker name -> WorkerStats (or None). `worker_gen_tokens_per_s` is the
    tokens the workers delivered per second that they were busy (summed over workers, so it
    is a per-worker rate); compile and reload seconds are summed. A worker whose totals went
    down restarted: its new totals count from zero. `worker_shared_weight_mb`: the workers'
    weights, as last reported, that are mapped from the parameter server's files, not copied.
    """
    fields = ("generated_tokens", "active_s", "engine_s", "compile_s", "reload_s")
    total = dict.fromkeys(fields, 0.0)
    for name, now in after.items():
        if now is None:
            continue
        then = before.get(name)
        restarted = (
            then is None or now.generated_tokens < then.generated_tokens or now.active_s < then.active_s
        )
        for field in fields:
            total[field] += getattr(now, field) - (0.0 if restarted else getattr(then, field))
    if total["active_s"] <= 0.0:
        return {}
    shared = sum(now.shared_weight_bytes for now in after.values() if now is not None)
    return {
        "worker_shared_weight_mb": shared / 2**20,
        "worker_gen_tokens_per_s": total["generated_tokens"] / total["active_s"],
        "worker_engine_tokens_per_s": total["generated_tokens"] / max(total["engine_s"], 1e-9),
        "worker_active_s": total["active_s"],
        "worker_compile_s": total["compile_s"],
        "worker_reload_s": total["reload_s"],
    }


def format_number(value: Any, digits: int = 3) -> str:
    """`value` for a table: "-" for None, floats with `digits` decimals."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


class ProgressDisplay:
    """Live progress: a rich table redrawn in place on a terminal, plain log lines otherwise."""

    COLUMNS = (
        ("step", "step"),
        ("version", "version"),
        ("reward", "reward_mean"),
        ("pass rate", "pass_rate"),
        ("gen tok/s", "gen_tokens_per_s"),
        ("staleness", "staleness_max"),
        ("queue", "queue_depth"),
        ("in flight", "inflight_groups"),
        ("workers", "workers_alive"),
    )

    def __init__(self, total_steps: int, *, stream: IO[str] | None = None, live: bool | None = None) -> None:
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.live_mode = self.stream.isatty() if live is None else live
        self.console = Console(file=self.stream, force_terminal=self.live_mode or None)
        self.last: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self._live: Live | None = None
        if self.live_mode:
            self._live = Live(self._table(), console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def _table(self) -> Table:
        table = Table(title=f"RLAX run: step {self.last.get('step', 0)}/{self.total_steps}")
        for title, _ in self.COLUMNS:
            table.add_column(title, justify="right")
        table.add_row(*(format_number(self.last.get(key)) for _, key in self.COLUMNS))
        if self.last_eval:
            evals = ", ".join(
                f"{k}={format_number(v)}"
                for k, v in self.last_eval.items()
                if k.startswith(("pass@", "reward"))
            )
            table.caption = f"eval @ step {self.last_eval.get('step')}: {evals}"
        return table

    def update(self, record: dict[str, Any]) -> None:
        if record.get("kind") == "eval":
            self.last_eval = record
        else:
            self.last = record
        if self._live is not None:
            self._live.update(self._table())
            return
        if record.get("kind") == "eval":
            values = " ".join(
                f"{k}={format_number(v)}"
                for k, v in record.items()
                if k.startswith(("pass@", "reward", "avg"))
            )
            print(f"[eval] step={record.get('step')} {values}", file=self.stream, flush=True)
        else:
            values = " ".join(
                f"{title.replace(' ', '_')}={format_number(record.get(key))}"
                for title, key in self.COLUMNS[1:]
            )
            print(
                f"[train] step={record.get('step')}/{self.total_steps} {values}", file=self.stream, flush=True
            )

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None


def trajectory_record(samples: Sequence[Any]) -> dict[str, float]:
    """Tool use of multi-turn trajectories (anything with `turns`, `tool_calls`,
    `tool_errors`, `end` and optionally `tool_correct`). Empty for single-turn samples.

    - `tool_use_rate`: share of trajectories that called a tool.
    - `tool_no_error_rate`: share that called a tool and none of whose calls failed (a
      call that ran says nothing of whether it asked the right question; this was
      `tool_ok_rate` before 2026-12).
    - `tool_ok_rate`: share that used a tool *correctly*, of the trajectories whose
      environment judged their tool use (`Sample.tool_correct` not None): for the
      calculator, a call returned the right answer and the final answer is that result. A
      trajectory that made no call was judged and did not use a tool correctly, so for the
      calculator the share is of all trajectories, like `tool_use_rate`, and never above
      it. Absent where no trajectory was judged (the `tools` and `python` environments
      cannot tell): read `tool_no_error_rate` there.
    - `turns_mean`, `tool_errors_mean` and `end_<reason>` shares.
    """
    ends = [s.end for s in samples]
    if not samples or not any(ends):
        return {}
    n = len(samples)
    record = {
        "tool_use_rate": sum(s.tool_calls > 0 for s in samples) / n,
        "tool_no_error_rate": sum(s.tool_calls > 0 and s.tool_errors == 0 for s in samples) / n,
        "turns_mean": sum(s.turns for s in samples) / n,
        "tool_errors_mean": sum(s.tool_errors for s in samples) / n,
    }
    judged = [s.tool_correct for s in samples if getattr(s, "tool_correct", None) is not None]
    if judged:
        record["tool_ok_rate"] = sum(bool(v) for v in judged) / len(judged)
    for reason in sorted(set(ends)):
        record[f"end_{reason}"] = ends.count(reason) / n
    return record


# A step's wall time (`step_time_s`, commit to commit) and its parts in the summary table.
STEP_TIME_PARTS = (
    "step_time_s",
    "trainer_wait_seconds",
    "train_seconds",
    "trainer_push_seconds",
    "trainer_checkpoint_seconds",
    "worker_active_s",
)


def summary_rows(records: list[dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(metric, start, end, change) rows: evaluation scores first, then training figures."""
    rows: list[tuple[str, str, str, str]] = []
    evals = latest_per_step(read for read in records if read.get("kind") == "eval")
    if evals:
        first, last = evals[0], evals[-1]
        keys = [
            k
            for k in first
            if k.startswith(
                ("pass@", "reward_mean", "avg@", "tool_use_rate", "tool_ok_rate", "tool_no_error_rate")
            )
        ]
        for key in keys:
            a, b = first.get(key), last.get(key)
            change = (
                f"{100 * (b - a):+.1f} pts"
                if isinstance(a, int | float) and isinstance(b, int | float)
                else "-"
            )
            rows.append(
                (
                    f"eval {key} (step {first['step']} -> {last['step']})",
                    format_number(a),
                    format_number(b),
                    change,
                )
            )
    train = latest_per_step(r for r in records if r.get("kind") == "train")
    if train:
        first, last = train[0], train[-1]
        keys = [
            "reward_mean",
            "pass_rate",
            "tool_use_rate",
            "tool_ok_rate",
            "tool_no_error_rate",
            "turns_mean",
            "staleness_max",
            "logprob_delta_p95",
            "gen_tokens_per_s",
            "worker_gen_tokens_per_s",
        ]
        for key in keys:
            if key in last:
                a, b = first.get(key), last.get(key)
                change = f"{b - a:+.3f}" if isinstance(a, int | float) and isinstance(b, int | float) else "-"
                rows.append((f"train {key}", format_number(a), format_number(b), change))
        # Engine-vs-trainer numerics: only steps that trained on same-version rollouts carry it.
        same = [r for r in train if r.get("on_policy_tokens")]
        if same:
            a, b = same[0]["logprob_mismatch_p95"], same[-1]["logprob_mismatch_p95"]
            label = f"train logprob_mismatch_p95 ({len(same)} same-version steps)"
            rows.append((label, f"{a:.1e}", f"{b:.1e}", f"{b - a:+.1e}"))
        # The trainer's peak memory (host RSS; device memory on accelerators): the first
        # step's figure (after compiling) and the highest any step reported.
        for key in ("trainer_peak_rss_mb", "trainer_peak_device_mb"):
            seen = [r[key] for r in train if isinstance(r.get(key), int | float)]
            if seen:
                rows.append(
                    (
                        f"train {key} (max)",
                        f"{seen[0]:.0f}",
                        f"{max(seen):.0f}",
                        f"{max(seen) - seen[0]:+.0f}",
                    )
                )
        # Compilation, counted apart from the step times: the workers' start-up warm-up and
        # any shape compiled during the run, and the trainer's update per padded length.
        for key in ("worker_compile_s", "trainer_compile_seconds"):
            compile_s = [r[key] for r in train if isinstance(r.get(key), int | float)]
            if compile_s:
                rows.append((f"train {key} (total)", f"{compile_s[0]:.1f}", f"{sum(compile_s):.1f}", "-"))
        # Where a step's wall time goes: the median over steps (the first step, with its
        # compilations, shown as the start) of the whole step and its largest parts.
        for key in STEP_TIME_PARTS:
            seen = [float(r[key]) for r in train if isinstance(r.get(key), int | float)]
            if seen:
                rows.append(
                    (f"train {key} (median)", f"{seen[0]:.3f}", f"{statistics.median(seen):.3f}", "-")
                )
        rows.append(
            (
                "train steps",
                format_number(first["step"]),
                format_number(last["step"]),
                f"{last['step'] - first['step']:+d}",
            )
        )
    return rows


def summary_table(records: list[dict[str, Any]], title: str = "RLAX run summary") -> Table:
    table = Table(title=title)
    for column in ("metric", "start", "end", "change"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for row in summary_rows(records):
        table.add_row(*row)
    return table


def moving_average(values: list[float], window: int) -> list[float]:
    """The mean of the last `window` finite values at each position (fewer at the start);
    NaN where none of them is finite."""
    averaged = []
    for i in range(len(values)):
        recent = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        averaged.append(sum(recent) / len(recent) if recent else math.nan)
    return averaged


def plot_run(
    records: list[dict[str, Any]], path: str | pathlib.Path, title: str = "RLAX run"
) -> pathlib.Path:
    """PNG with training reward, evaluation pass@k and |Δ logprob| against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = latest_per_step(r for r in records if r.get("kind") == "train")
    evals = latest_per_step(r for r in records if r.get("kind") == "eval")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    steps = [r["step"] for r in train]
    rewards = [float(r.get("reward_mean", math.nan)) for r in train]
    axes[0].plot(steps, rewards, ".", alpha=0.35, label="train reward (batch mean)")
    window = max(1, min(25, len(rewards) // 10))
    if window > 1:
        axes[0].plot(steps, moving_average(rewards, window), lw=2, label=f"moving average ({window} steps)")
    # Correct tool use where the environment judges it, else calls that did not fail.
    for key, label in (
        ("tool_ok_rate", "tool used correctly (share)"),
        ("tool_no_error_rate", "tool called without an error (share)"),
    ):
        share = [float(r.get(key, math.nan)) for r in train]
        if any(math.isfinite(v) for v in share):
            axes[0].plot(steps, moving_average(share, window), lw=2, label=label)
            break
    axes[0].set_title("training reward")
    eval_keys = sorted(
        {
            k
            for r in evals
            for k in r
            if k.startswith(("pass@", "reward_mean", "tool_ok_rate", "tool_no_error_rate"))
        }
    )
    for key in eval_keys:
        axes[1].plot([r["step"] for r in evals], [r.get(key, math.nan) for r in evals], marker="o", label=key)
    axes[1].set_title("evaluation")
    axes[1].set_ylim(-0.02, 1.02)
    for key in ("logprob_delta_p50", "logprob_delta_p95", "logprob_delta_max"):
        values = [r.get(key, math.nan) for r in train]
        if any(isinstance(v, int | float) and math.isfinite(v) for v in values):
            axes[2].plot(steps, values, marker=".", label=key.replace("logprob_delta_", "|Δ logprob| "))
    # Rollouts of the weights the update started from only: engine-vs-trainer numerics.
    mismatch = [
        r.get("logprob_mismatch_p95", math.nan) if r.get("on_policy_tokens") else math.nan for r in train
    ]
    if any(math.isfinite(v) for v in mismatch):
        axes[2].plot(steps, mismatch, marker="x", label="|Δ logprob| p95, same-version rollouts")
    axes[2].set_title("trainer vs worker |Δ logprob|")
    for axis in axes:
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
    return path


def print_summary(
    records: list[dict[str, Any]], console: Console | None = None, title: str = "RLAX run summary"
) -> None:
    (console or Console()).print(summary_table(records, title))
