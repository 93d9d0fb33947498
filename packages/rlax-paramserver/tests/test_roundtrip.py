"""Push/pull semantics on one in-process server."""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

from rlax_paramserver import ParamClient, StaleVersionError, VersionNotFoundError
from rlax_paramserver.testing import running_server


def model_sized_tree(seed: int = 0) -> dict:
    """~40 MB of mixed float32/bfloat16/int32 under nested names, with tensors spanning several frames."""
    rng = np.random.default_rng(seed)
    tree: dict = {
        "embed": {"tokens": rng.standard_normal((8192, 576), dtype=np.float32)},
        "final_norm": rng.standard_normal(576, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "step": np.array(12345, dtype=np.int32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "layers": {},
    }
    for i in range(4):
        tree["layers"][str(i)] = {
            "attn": {
                name: rng.standard_normal((576, 576), dtype=np.float32).astype(ml_dtypes.bfloat16)
                for name in "qkvo"
            },
            "mlp": {
                "gate": rng.standard_normal((576, 1536), dtype=np.float32),
                "down": rng.standard_normal((1536, 576), dtype=np.float32),
            },
            "positions": rng.integers(-(2**31), 2**31 - 1, size=(77,), dtype=np.int32),
        }
    return tree


def assert_trees_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            assert_trees_bit_equal(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            assert a[key].tobytes() == b[key].tobytes(), key


def test_model_sized_tree_round_trips_bit_exactly(tmp_path) -> None:
    tree = model_sized_tree()
    with (
        running_server(tmp_path) as address,
        ParamClient(address, timeout_s=20, chunk_bytes=4 << 20, message_bytes=8 << 20) as client,
    ):
        assert client.latest() is None
        committed = client.push(tree, 1, {"step": 1, "note": "first"})
        assert committed.version == 1 and committed.persisted
        pulled = client.pull()
        assert pulled is not None and pulled.version == 1 and pulled.metadata == {"step": 1, "note": "first"}
        assert_trees_bit_equal(pulled.tree, tree)
        assert client.pull(1) is not None
        stats = client.stat()
        assert stats.versions == (1,) and stats.persisted_version == 1 and stats.pulls_in_flight == 0


def test_versions_must_increase_and_missing_versions_are_errors() -> None:
    with running_server() as address, ParamClient(address, timeout_s=5) as client:
        with pytest.raises(VersionNotFoundError, match="no version"):
            client.pull()
        client.push({"w": np.zeros(3, np.float32)}, 5)
        for stale in (5, 4):
            with pytest.raises(
                StaleVersionError, match=f"version {stale} is not newer than the latest committed version 5"
            ):
                client.push({"w": np.ones(3, np.float32)}, stale)
        with pytest.raises(VersionNotFoundError, match="version 3 is not held"):
            client.pull(3)
        assert client.pull(if_newer_than=5) is None
        pulled = client.pull(if_newer_than=4)
        assert pulled is not None and pulled.version == 5 and np.all(pulled.tree["w"] == 0)
        # An empty tree is a valid version (a shard may own no tensor).
        client.push({}, 6)
        pulled = client.pull()
        assert pulled is not None and pulled.version == 6 and pulled.tree == {}


def test_wait_for_newer_is_woken_by_a_commit_not_by_polling() -> None:
    with (
        running_server() as address,
        ParamClient(address, timeout_s=5) as waiter,
        ParamClient(address, timeout_s=5) as pusher,
    ):
        assert waiter.wait_for_newer(None, 0.2) is None
        pusher.push({"w": np.zeros(1, np.float32)}, 1)
        assert waiter.wait_for_newer(None, 1.0) == 1  # already newer: immediate
        timer = threading.Timer(0.3, lambda: pusher.push({"w": np.ones(1, np.float32)}, 2))
        timer.start()
        started = time.monotonic()
        try:
            assert waiter.wait_for_newer(1, 20.0) == 2
        finally:
            timer.join()
        assert time.monotonic() - started < 15  # woken by the commit, long before its own deadline
        assert waiter.wait_for_newer(2, 0.2) is None
        # One long-poll exchange per wait, not a request storm.
        assert waiter._rpc._next_id < 10


def test_pull_is_one_consistent_version_while_newer_ones_commit(stamp) -> None:
    make, check = stamp
    with (
        running_server(keep=2) as address,
        ParamClient(address, timeout_s=5, chunk_bytes=1024, message_bytes=2048, window=1) as puller,
    ):
        with ParamClient(address, timeout_s=5) as pusher:
            pusher.push(make(1), 1)
            # Start the pull by hand so that versions commit between its fetches.
            from rlax_protocol import FetchChunks, PullBegin, PullEnd, decode_tree, frame_layout

            granted = puller._rpc.call(PullBegin()).message
            frames = []
            for index in range(len(frame_layout(granted.manifest))):
                if index == 1:
                    for v in range(2, 6):
                        pusher.push(make(v), v)
                frames += puller._rpc.call(FetchChunks(granted.lease_id, index, 1)).frames
            puller._rpc.call(PullEnd(granted.lease_id))
            check(decode_tree(granted.manifest, frames), 1)
            assert pusher.stat().versions == (4, 5)
