"""Issue 16: with a state dir the newest `keep` versions are on disk and served again after a restart."""

from __future__ import annotations

import errno
import mmap
import pathlib
from typing import Any

import numpy as np
import pytest

from rlax_paramserver import ParamClient, VersionNotFoundError
from rlax_paramserver.persist import StateReadError, load_states, state_path
from rlax_paramserver.testing import running_server, running_server_process


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}/"))
        else:
            out[prefix + key] = np.asarray(value)
    return out


def assert_same_bytes(pulled: dict[str, Any], pushed: dict[str, Any]) -> None:
    got, want = _leaves(pulled), _leaves(pushed)
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


def state_files(state_dir: pathlib.Path) -> list[str]:
    """Every entry of the state dir (temporary and corrupt files included), sorted."""
    return sorted(p.name for p in state_dir.iterdir())


def names(state_dir: pathlib.Path, *versions: int) -> list[str]:
    return sorted(state_path(state_dir, v).name for v in versions)


def test_keep_3_restart_after_kill_9_serves_the_newest_three_bit_exactly(tmp_path, stamp) -> None:
    make, _ = stamp
    with running_server_process(tmp_path, keep=3) as server:
        with ParamClient(server.address, timeout_s=10) as client:
            for version in range(1, 6):
                assert client.push(make(version), version, {"v": version}).persisted
            assert client.stat().versions == (3, 4, 5)
        assert state_files(tmp_path) == names(tmp_path, 3, 4, 5)
        server.kill()
        assert server.process.returncode == -9
    with (
        running_server_process(tmp_path, keep=3) as server,
        ParamClient(server.address, timeout_s=10) as client,
    ):
        stats = client.stat()
        assert stats.versions == (3, 4, 5) and stats.latest == 5
        assert stats.persisted_version == 5 and stats.state_error is None
        assert client.latest() == 5
        for version in (3, 4, 5):
            pulled = client.pull(version)
            assert pulled is not None and pulled.version == version and pulled.metadata == {"v": version}
            assert_same_bytes(pulled.tree, make(version))
        for version in (1, 2):
            with pytest.raises(VersionNotFoundError):
                client.pull(version)
        latest = client.pull()
        assert latest is not None and latest.version == 5
        # It goes on from there: the next push replaces the oldest file.
        assert client.push(make(6), 6, {"v": 6}).persisted
        assert client.stat().versions == (4, 5, 6)
    assert state_files(tmp_path) == names(tmp_path, 4, 5, 6)


@pytest.mark.parametrize(("corrupt", "served"), [(4, (3, 5)), (5, (3, 4)), (3, (4, 5))])
def test_a_corrupt_file_among_the_kept_is_skipped_named_and_set_aside(
    tmp_path, stamp, corrupt: int, served: tuple[int, ...]
) -> None:
    make, _ = stamp
    with running_server(tmp_path, keep=3) as address, ParamClient(address, timeout_s=5) as client:
        for version in range(1, 6):
            client.push(make(version), version, {"v": version})
    path = state_path(tmp_path, corrupt)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01  # a tensor byte: only the checksum can tell
    path.write_bytes(bytes(data))
    with (
        running_server_process(tmp_path, keep=3) as server,
        ParamClient(server.address, timeout_s=10) as client,
    ):
        stats = client.stat()
        assert stats.versions == served and stats.latest == max(served)
        assert stats.state_error is not None and path.name in stats.state_error
        with pytest.raises(VersionNotFoundError):
            client.pull(corrupt)
        for version in served:
            pulled = client.pull(version)
            assert pulled is not None and pulled.metadata == {"v": version}
            assert_same_bytes(pulled.tree, make(version))
        # A corrupt file is never read again; a new push keeps the newest three valid ones.
        assert client.push(make(6), 6).persisted
        assert client.stat().state_error is None
    kept = sorted([*served, 6])[-3:]
    assert state_files(tmp_path) == sorted([*names(tmp_path, *kept), path.name + ".corrupt"])


def test_keep_1_persists_and_restores_only_the_newest_as_before(tmp_path, stamp) -> None:
    make, check = stamp
    with running_server_process(tmp_path, keep=1) as server:
        with ParamClient(server.address, timeout_s=10) as client:
            for version in (1, 2, 3):
                assert client.push(make(version), version, {"v": version}).persisted
                assert state_files(tmp_path) == names(tmp_path, version)
        server.kill()
    with (
        running_server_process(tmp_path, keep=1) as server,
        ParamClient(server.address, timeout_s=10) as client,
    ):
        stats = client.stat()
        assert stats.versions == (3,) and stats.persisted_version == 3 and stats.state_error is None
        pulled = client.pull()
        assert pulled is not None and pulled.version == 3 and pulled.metadata == {"v": 3}
        check(pulled.tree, 3)
        with pytest.raises(VersionNotFoundError):
            client.pull(2)


def test_a_state_dir_with_one_file_still_loads_under_a_larger_keep(tmp_path, stamp) -> None:
    make, _ = stamp
    with running_server(tmp_path, keep=1) as address, ParamClient(address, timeout_s=5) as client:
        for version in (1, 2):
            client.push(make(version), version)
    assert state_files(tmp_path) == names(tmp_path, 2)
    with running_server(tmp_path, keep=3) as address, ParamClient(address, timeout_s=5) as client:
        assert client.stat().versions == (2,)
        pulled = client.pull(2)
        assert pulled is not None
        assert_same_bytes(pulled.tree, make(2))
        client.push(make(3), 3)
        client.push(make(4), 4)
    assert state_files(tmp_path) == names(tmp_path, 2, 3, 4)


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_disk_holds_exactly_the_newest_keep_files_after_every_push(tmp_path, keep: int) -> None:
    tree = {"w": np.arange(256, dtype=np.float32)}
    with running_server(tmp_path, keep=keep) as address, ParamClient(address, timeout_s=5) as client:
        for version in range(1, 7):
            assert client.push(tree, version).persisted
            newest = list(range(max(1, version - keep + 1), version + 1))
            assert state_files(tmp_path) == names(tmp_path, *newest)  # nothing half-written
            assert client.stat().versions == tuple(newest)


def test_restart_with_a_smaller_keep_serves_fewer_and_trims_on_the_next_push(tmp_path) -> None:
    tree = {"w": np.arange(16, dtype=np.float32)}
    with running_server(tmp_path, keep=5) as address, ParamClient(address, timeout_s=5) as client:
        for version in range(1, 6):
            client.push(tree, version)
    assert state_files(tmp_path) == names(tmp_path, 1, 2, 3, 4, 5)
    with running_server(tmp_path, keep=2) as address, ParamClient(address, timeout_s=5) as client:
        assert client.stat().versions == (4, 5)
        client.push(tree, 6)
    assert state_files(tmp_path) == names(tmp_path, 5, 6)


def test_loaded_versions_are_each_one_mapping_of_their_own_file(tmp_path, stamp) -> None:
    make, _ = stamp
    with running_server(tmp_path, keep=3) as address, ParamClient(address, timeout_s=5) as client:
        for version in range(1, 5):
            client.push(make(version), version)
    states, error = load_states(tmp_path, 3)
    assert error is None and [s.version for s in states] == [2, 3, 4]
    for state in states:
        buffers = {id(frame.obj) for frame in state.frames}
        assert len(buffers) == 1  # frames slice the one mapping of the file: no copies
        assert isinstance(state.frames[0].obj, mmap.mmap)
        assert len(state.frames[0].obj) == state.path.stat().st_size
    with running_server(tmp_path, keep=3) as address, ParamClient(address, timeout_s=5) as client:
        assert client.stat().bytes_held == sum(s.manifest.total_bytes for s in states)


def test_an_unreadable_older_kept_file_fails_the_start_and_is_left_alone(tmp_path, monkeypatch) -> None:
    from rlax_paramserver import persist

    tree = {"w": np.arange(16, dtype=np.float32)}
    with running_server(tmp_path, keep=3) as address, ParamClient(address, timeout_s=5) as client:
        for version in (1, 2, 3):
            client.push(tree, version)
    before = state_files(tmp_path)
    unreadable = state_path(tmp_path, 2)
    real_read = persist.read_state

    def failing_read(path: pathlib.Path) -> persist.LoadedState:
        if path == unreadable:
            raise OSError(errno.EIO, "Input/output error", str(path))
        return real_read(path)

    monkeypatch.setattr(persist, "read_state", failing_read)
    with pytest.raises(StateReadError, match=f"cannot read state file {unreadable}"):
        load_states(tmp_path, 3)
    with pytest.raises(StateReadError), running_server(tmp_path, keep=3):
        pass
    assert state_files(tmp_path) == before
    # keep=1 never reads it: the newest alone is served as before.
    with running_server(tmp_path, keep=1) as address, ParamClient(address, timeout_s=5) as client:
        assert client.stat().versions == (3,)


def test_without_fsync_a_version_is_written_whole_without_flushing_and_survives_kill_9(
    tmp_path, stamp, monkeypatch
) -> None:
    """`--no-fsync` (`paramserver.fsync: false`): the write never calls fsync, and what a
    SIGKILLed server had committed is served again after its restart (the kernel kept it)."""
    from rlax_paramserver import persist
    from rlax_protocol import encode_tree

    def no_fsync(fd: int) -> None:
        raise AssertionError("fsync called with fsync=False")

    make, _ = stamp
    with monkeypatch.context() as patch:
        patch.setattr(persist.os, "fsync", no_fsync)
        encoded = encode_tree(make(1))
        persist.write_state(tmp_path / "direct", 1, encoded.manifest, {"v": 1}, encoded.frames, fsync=False)
    (loaded,), error = load_states(tmp_path / "direct", keep=1)
    assert error is None
    assert loaded.version == 1 and loaded.metadata == {"v": 1}
    with running_server_process(tmp_path / "served", keep=2, args=["--no-fsync"]) as server:
        with ParamClient(server.address, timeout_s=10) as client:
            for version in (1, 2, 3):
                assert client.push(make(version), version, {"v": version}).persisted
        server.kill()
    with (
        running_server_process(tmp_path / "served", keep=2) as server,
        ParamClient(server.address, timeout_s=10) as client,
    ):
        assert client.stat().versions == (2, 3)
        pulled = client.pull(3)
        assert pulled is not None and pulled.metadata == {"v": 3}
        assert_same_bytes(pulled.tree, make(3))
