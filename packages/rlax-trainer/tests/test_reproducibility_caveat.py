"""The trainer says when its objective makes a run's trajectory depend on timing: an
off-policy correction reads the workers' log-probs, whose last bits move with the rows
that share an engine batch unless `trainer.batch_invariant` is on."""

from __future__ import annotations

import pathlib

import pytest

from rlax_core.config import load_config
from rlax_trainer.trainer_process import learner_config, reproducibility_caveat

DEMO = pathlib.Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
TIS = "trainer.objective.importance.correction={kind: tis, upper: 2.0}"


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        ([], False),  # the demo: no correction, the workers' log-probs do not reach the loss
        (["controller.lag=2", TIS], True),
        (["controller.lag=2", "trainer.objective.importance.correction={kind: mis, upper: 2.0}"], True),
        (["controller.lag=2", TIS, "trainer.batch_invariant=true"], False),
    ],
)
def test_a_correction_without_batch_invariance_is_named(overrides: list[str], warned: bool) -> None:
    caveat = reproducibility_caveat(learner_config(load_config(DEMO, overrides), mode="rl"))
    assert bool(caveat) == warned
    if warned:
        assert "trainer.batch_invariant: true" in caveat and "correction.kind=" in caveat
