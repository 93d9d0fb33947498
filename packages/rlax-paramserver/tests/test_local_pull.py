"""Weights shared on one host: versions are served from mapped state files, and a puller on
the same host maps the file instead of receiving the bytes.

What is checked: the server keeps no anonymous copy of a persisted version; a local pull's
arrays are views of the state file, 64-byte aligned, equal to what was pushed; a file that
is not the granted version (replaced, removed) is never trusted and the bytes come over
the network instead; version-1 files (tensors back to back) still load.
"""

from __future__ import annotations

import mmap
import os
import pathlib
from typing import Any

import ml_dtypes
import msgspec
import numpy as np
import pytest

from rlax_paramserver import ParamClient
from rlax_paramserver.persist import (
    ALIGN,
    MAGIC_V1,
    StateHeader,
    load_states,
    map_state,
    state_path,
)
from rlax_paramserver.testing import running_server, running_server_process
from rlax_protocol import PROTOCOL_VERSION, encode_tree
from rlax_protocol.procfs import memory_mb


def odd_tree(version: int) -> dict[str, Any]:
    """Tensors whose sizes are not multiples of 64 bytes, so alignment needs padding."""
    return {
        "a": np.arange(3, dtype=np.float32) + version,
        "b": np.arange(5, dtype=np.int8) + version,
        "c": np.full((7, 11), version, dtype=ml_dtypes.bfloat16),
        "d": {"e": np.full((13,), version, dtype=np.float32)},
    }


def mapping_of(array: np.ndarray) -> Any:
    """The object at the bottom of an array's chain of buffers (an `mmap` for a mapped file)."""
    base: Any = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base.obj if isinstance(base, memoryview) else base


def leaves(tree: dict[str, Any]) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for value in tree.values():
        out.extend(leaves(value) if isinstance(value, dict) else [value])
    return out


def test_a_pull_on_the_same_host_maps_the_state_file(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push(odd_tree(1), 1)
        client.push(odd_tree(2), 2)
        pulled = client.pull()
        older = client.pull(1)
        assert client.stat().pulls_in_flight == 0  # each mapped pull ended its lease
    assert pulled is not None and older is not None
    assert pulled.mapped and older.mapped and pulled.version == 2
    for got, want in zip(leaves(pulled.tree), leaves(odd_tree(2)), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
        assert isinstance(mapping_of(got), mmap.mmap)
        assert got.ctypes.data % 64 == 0  # what lets XLA:CPU alias it instead of copying
        assert not got.flags.writeable
    assert np.array_equal(older.tree["a"], odd_tree(1)["a"])


def test_without_local_or_without_a_state_dir_the_bytes_are_sent(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5, local=False) as client:
        client.push(odd_tree(1), 1)
        pulled = client.pull()
    assert pulled is not None and not pulled.mapped
    assert not isinstance(mapping_of(pulled.tree["a"]), mmap.mmap)
    with running_server() as address, ParamClient(address, timeout_s=5) as client:
        client.push(odd_tree(1), 1)
        pulled = client.pull()
    assert pulled is not None and not pulled.mapped
    assert np.array_equal(pulled.tree["d"]["e"], odd_tree(1)["d"]["e"])


def test_a_replaced_or_removed_file_is_not_trusted(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push(odd_tree(1), 1)
        path = state_path(tmp_path, 1)
        # Another file under the version's name (same size, one data byte changed): the
        # server still serves its own mapping of the pushed bytes; the puller's checksum
        # check refuses the file and it receives the bytes instead.
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x40
        forged = tmp_path / "forged"
        forged.write_bytes(bytes(data))
        os.replace(forged, path)
        pulled = client.pull()
        assert pulled is not None and not pulled.mapped
        assert np.array_equal(pulled.tree["d"]["e"], odd_tree(1)["d"]["e"])
        path.unlink()
        pulled = client.pull()
        assert pulled is not None and not pulled.mapped
        assert np.array_equal(pulled.tree["c"], odd_tree(1)["c"])


def test_a_file_of_another_version_with_the_same_bytes_is_refused(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push(odd_tree(1), 1)
        client.push(odd_tree(1), 2)  # the same bytes: only the header's version differs
        os.replace(state_path(tmp_path, 1), state_path(tmp_path, 2))
        pulled = client.pull(2)
    assert pulled is not None and pulled.version == 2 and not pulled.mapped


def rss_anon_mb(pid: int, field: str = "RssAnon") -> float:
    mib = memory_mb(pid, field)
    assert mib is not None, f"process {pid} is gone"
    return mib


@pytest.mark.parametrize("by_file", [True, False], ids=["pushed-by-file", "pushed-over-the-socket"])
def test_the_server_holds_no_copy_of_a_persisted_version(tmp_path, by_file: bool) -> None:
    # 2 x 40 MB tensors a version (above glibc's largest mmap threshold, so freed frames go
    # back to the kernel), 3 versions pushed with keep=2.
    def big(version: int) -> dict[str, np.ndarray]:
        return {name: np.full(10 << 20, version + i, np.float32) for i, name in enumerate("xy")}

    with (
        running_server_process(tmp_path, keep=2) as server,
        ParamClient(server.address, timeout_s=10, local=by_file) as client,
    ):
        baseline = rss_anon_mb(server.process.pid)
        file_baseline = rss_anon_mb(server.process.pid, "RssFile")
        for version in (1, 2, 3):
            client.push(big(version), version)
        after = rss_anon_mb(server.process.pid)
        # Nor through its mappings: verifying a pushed file reads it without mapping it, so
        # the version's pages are counted in the memory of the workers that map them.
        file_after = rss_anon_mb(server.process.pid, "RssFile")
        assert client.stat().versions == (2, 3)
        with ParamClient(server.address, timeout_s=10, local=False) as network:
            pulled = network.pull()  # sent from the mapping: file pages, not anonymous ones
        served = rss_anon_mb(server.process.pid)
    assert pulled is not None and not pulled.mapped and np.all(pulled.tree["y"] == 4.0)
    # Held in memory before: 2 versions (160 MB) of received frames. Now: none of them.
    assert after - baseline < 20, f"server anonymous memory grew {after - baseline:.0f} MB"
    assert file_after - file_baseline < 20, f"server's mapped pages grew {file_after - file_baseline:.0f} MB"
    assert served - baseline < 20, f"server anonymous memory grew {served - baseline:.0f} MB serving a pull"


def write_v1_file(directory: pathlib.Path, version: int, tree: dict[str, Any]) -> pathlib.Path:
    """A state file as version-1 servers wrote it: tensors back to back after the header."""
    encoded = encode_tree(tree, chunk_bytes=1 << 20)
    header = msgspec.msgpack.encode(StateHeader(PROTOCOL_VERSION, version, encoded.manifest, {"v": 1}))
    prefix = MAGIC_V1 + len(header).to_bytes(8, "little") + header
    path = state_path(directory, version)
    with open(path, "wb") as f:
        f.write(prefix + b"\x00" * ((-len(prefix)) % ALIGN))
        for frame in encoded.frames:
            f.write(frame)
    return path


def test_version_1_files_still_load(tmp_path) -> None:
    path = write_v1_file(tmp_path, 4, odd_tree(4))
    state = map_state(path)
    assert state.version == 4 and state.metadata == {"v": 1}
    states, error = load_states(tmp_path, 1)
    assert error is None and states[0].version == 4
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        pulled = client.pull()
    assert pulled is not None and pulled.version == 4
    for got, want in zip(leaves(pulled.tree), leaves(odd_tree(4)), strict=True):
        assert np.array_equal(got, want)


def test_a_mapped_file_that_disagrees_with_the_expected_manifest_is_refused(tmp_path) -> None:
    from rlax_paramserver.persist import CorruptStateError

    path = write_v1_file(tmp_path, 1, odd_tree(1))
    other = encode_tree(odd_tree(2)).manifest
    with pytest.raises(CorruptStateError, match="another manifest"):
        map_state(path, expect=other)
