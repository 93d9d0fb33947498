from __future__ import annotations

import pathlib

import pytest

from rlax_controller.snapshot import RunSnapshot, SnapshotError, SnapshotStore


def make(step: int) -> RunSnapshot:
    return RunSnapshot(
        step=step,
        version=step,
        stream_state={"cursor": step * 4, "rng": {"state": [1, 2, 3]}, "epoch": 0},
        stream_index=step * 4,
        rng_state={"bit_generator": "PCG64", "state": {"state": 12345678901234567890, "inc": 3}},
        counters={"rollouts_generated": 10 * step},
        checkpoint=f"step_{step}",
        batch_rollout_ids=[f"{step}:0:0"],
    )


def test_write_read_latest_and_prune(tmp_path: pathlib.Path) -> None:
    store = SnapshotStore(tmp_path / "snap", keep=3)
    assert store.latest() is None
    for step in range(6):
        store.write(make(step))
    assert store.steps() == [3, 4, 5]
    assert store.read(4) == make(4)
    assert store.latest() == make(5)
    assert not list((tmp_path / "snap").glob(".*tmp*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage", "edit"])
def test_corrupt_snapshot_gives_clear_error(tmp_path: pathlib.Path, damage: str) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    path = store.write(make(2))
    data = path.read_bytes()
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data = data.replace(b'"cursor": 8', b'"cursor": 9')
    elif damage == "garbage":
        data = b"\x00\xff not json"
    else:
        data = data.replace(b'"step": 2', b'"step": "two"')
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=r"step-000002\.json.*corrupt"):
        store.read(2)


def test_missing_snapshot_names_steps(tmp_path: pathlib.Path) -> None:
    store = SnapshotStore(tmp_path, keep=2)
    store.write(make(1))
    with pytest.raises(SnapshotError, match=r"no snapshot for step 7.*\[1\]"):
        store.read(7)
