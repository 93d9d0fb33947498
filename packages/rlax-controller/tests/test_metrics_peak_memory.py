"""The run summary reports the trainer's peak memory from the step metrics."""

from __future__ import annotations

import io

from rich.console import Console

from rlax_controller.metrics import summary_rows, summary_table


def test_summary_has_trainer_peak_memory() -> None:
    records = [
        {"kind": "train", "step": 1, "reward_mean": 0.1, "trainer_peak_rss_mb": 2900.4},
        {"kind": "train", "step": 2, "reward_mean": 0.2, "trainer_peak_rss_mb": 3310.0},
        {"kind": "train", "step": 3, "reward_mean": 0.3, "trainer_peak_rss_mb": 3200.0},
    ]
    rows = {r[0]: r for r in summary_rows(records)}
    assert rows["train trainer_peak_rss_mb (max)"][1:] == ("2900", "3310", "+410")
    assert not any("device" in name for name in rows)  # no accelerator figure reported: no row
    out = io.StringIO()
    Console(file=out, width=120).print(summary_table(records))
    assert "trainer_peak_rss_mb" in out.getvalue()
