"""The trainer's batch journal: whole-or-absent entries, checksums that catch damage, pruning."""

from __future__ import annotations

import pathlib

import pytest

from rlax_protocol import Rollout
from rlax_protocol.control_messages import TrainBatch, decode_control, encode_control
from rlax_trainer.journal import BatchJournal, JournalDamagedError


def _batch(step: int) -> TrainBatch:
    rollout = Rollout(
        prompt_id=f"p{step}",
        group_index=0,
        prompt_token_ids=(1, 2, 3),
        completion_token_ids=(4, 5),
        worker_logprobs=(-0.5, -0.25),
        policy_version=step,
        reward=1.0,
    )
    return TrainBatch(step=step, group_size=1, rollouts=(rollout,), rollout_ids=(f"p{step}/0",))


def test_an_entry_reads_back_as_the_batch_that_was_written(tmp_path: pathlib.Path) -> None:
    journal = BatchJournal(tmp_path / "journal")
    assert journal.read(0) is None and journal.steps() == []
    for step in (0, 1, 2):
        journal.write(step, encode_control(_batch(step)))
    assert journal.steps() == [0, 1, 2]
    assert decode_control(journal.read(1) or b"") == _batch(1)
    # Written to a temporary name and renamed: nothing else is left in the folder.
    assert sorted(p.name for p in (tmp_path / "journal").iterdir()) == [
        "step-00000000.batch",
        "step-00000001.batch",
        "step-00000002.batch",
    ]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "SHA-256"),  # one flipped bit
        (lambda data: data[:-3], "SHA-256"),  # truncated payload
        (lambda data: data[:20], "header"),  # truncated header
        (lambda data: b"PICKLE!!" + data[8:], "header"),  # someone else's file
        (lambda data: b"", "header"),
    ],
)
def test_a_damaged_entry_is_reported_with_its_file(tmp_path: pathlib.Path, damage, reason: str) -> None:
    journal = BatchJournal(tmp_path)
    journal.write(7, encode_control(_batch(7)))
    path = tmp_path / "step-00000007.batch"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(JournalDamagedError, match=reason) as info:
        journal.read(7)
    assert str(path) in str(info.value)


def test_prune_keeps_what_a_kept_checkpoint_needs(tmp_path: pathlib.Path) -> None:
    journal = BatchJournal(tmp_path)
    for step in range(6):
        journal.write(step, encode_control(_batch(step)))
    (tmp_path / "notes.txt").write_text("not an entry")
    (tmp_path / "step-12.batch").write_text("too few digits: not an entry")
    journal.prune(before=2)
    assert journal.steps() == [2, 3, 4, 5]
    journal.prune_from(4)
    assert journal.steps() == [2, 3]
    journal.clear()
    assert journal.steps() == []
    assert (tmp_path / "notes.txt").exists()


def test_negative_steps_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="step"):
        BatchJournal(tmp_path).write(-1, b"x")
