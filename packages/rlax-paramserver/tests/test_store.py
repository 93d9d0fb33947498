"""The version store without sockets: commit verification and retention rules."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_paramserver import ServerConfig
from rlax_paramserver.store import StoreError, VersionStore
from rlax_protocol import encode_tree


def pushed(store: VersionStore, version: int, *, corrupt: bool = False, check: bool = True) -> None:
    encoded = encode_tree(
        {"a": np.full(40, version, np.float32), "b": np.arange(3, dtype=np.int32)}, chunk_bytes=64
    )
    frames = [memoryview(bytes(f)) for f in encoded.frames]
    if corrupt:
        frames[0] = memoryview(b"\xff" + bytes(frames[0])[1:])
    push_id = store.begin_push(version, encoded.manifest, {}, b"me")
    for tensor_check in store.put_chunks(push_id, 0, frames):
        if check:
            store.record_check(tensor_check, store.hash_frames(tensor_check.frames))
    push = store.take_for_commit(push_id)
    store.verify(push)
    store.commit(push)


def test_commit_verifies_tensors_not_checked_on_arrival() -> None:
    store = VersionStore(ServerConfig(keep=2))
    pushed(store, 1, check=False)
    with pytest.raises(StoreError, match="tensor 'a' of version 2 arrived corrupt"):
        pushed(store, 2, corrupt=True, check=False)
    assert store.latest == 1


def test_retention_keeps_newest_and_leased() -> None:
    store = VersionStore(ServerConfig(keep=2))
    pushed(store, 1)
    granted = store.begin_pull(1, None)
    assert not isinstance(granted, int) and granted is not None
    lease, _ = granted
    for version in (2, 3, 4):
        pushed(store, version)
    assert sorted(store.versions) == [1, 3, 4]
    store.end_pull(lease.lease_id)
    assert sorted(store.versions) == [3, 4]
    assert store.begin_pull(None, 4) == 4  # not newer


def test_overlapping_pushes_commit_in_version_order_only() -> None:
    store = VersionStore(ServerConfig(keep=3))
    pending = {}
    for version in (2, 3):
        encoded = encode_tree({"w": np.full(8, version, np.float32)})
        push_id = store.begin_push(version, encoded.manifest, {}, f"pusher-{version}".encode())
        store.put_chunks(push_id, 0, [memoryview(bytes(f)) for f in encoded.frames])
        pending[version] = push_id
    newer = store.take_for_commit(pending[3])
    store.verify(newer)
    store.commit(newer)
    with pytest.raises(StoreError, match="version 2 is not newer than the latest committed version 3"):
        store.take_for_commit(pending[2])
    assert sorted(store.versions) == [3]
