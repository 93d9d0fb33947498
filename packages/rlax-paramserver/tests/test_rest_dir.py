"""A parameter server serving from a folder in memory (`state_dir` on a tmpfs) whose
versions rest in `rest_dir` while it is stopped (`paramserver.storage: memory`).

What is checked: a stop copies the newest `keep` versions to the rest folder and clears
the memory folder; a start with an empty memory folder serves them again (same bytes);
a server killed with SIGKILL copies nothing, and its restart serves the memory folder's
versions, which are newer than the rest folder's; a bad rest folder is refused by name.
"""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from rlax_paramserver import ParamClient
from rlax_paramserver.config import ServerConfig
from rlax_paramserver.persist import spill_states
from rlax_paramserver.testing import running_server, running_server_process


def tree(version: int) -> dict[str, Any]:
    return {"w": np.arange(1000, dtype=np.float32) * version, "b": np.full((7, 3), version, dtype=np.int8)}


def versions(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.glob("weights-v*.rlaxw")) if folder.is_dir() else []


def pulled(address: str, version: int | str = "latest") -> tuple[int, dict[str, Any]]:
    with ParamClient(address, timeout_s=10) as client:
        got = client.pull(version)  # type: ignore[arg-type]
        assert got is not None
        return got.version, got.tree


def test_a_stop_moves_the_versions_to_rest_and_a_start_serves_them_again(tmp_path: pathlib.Path) -> None:
    live, rest = tmp_path / "shm" / "live", tmp_path / "run" / "paramserver"
    with running_server(live, keep=2, rest_dir=rest) as address, ParamClient(address, timeout_s=10) as client:
        for version in (1, 2, 3):
            client.push(tree(version), version)
        assert versions(live) == ["weights-v000000000002.rlaxw", "weights-v000000000003.rlaxw"]
        assert versions(rest) == []  # nothing touches the disk while serving
    assert not live.exists(), "the memory folder outlived its server"
    assert versions(rest) == ["weights-v000000000002.rlaxw", "weights-v000000000003.rlaxw"]

    with running_server(live, keep=2, rest_dir=rest) as address:
        assert versions(live) == versions(rest)
        version, got = pulled(address)
        assert version == 3
        np.testing.assert_array_equal(got["w"], tree(3)["w"])
        assert pulled(address, 2)[0] == 2
    assert not live.exists()


def test_a_killed_server_restarts_from_its_memory_folder_not_the_older_rest(tmp_path: pathlib.Path) -> None:
    live, rest = tmp_path / "live", tmp_path / "rest"
    args = ["--rest-dir", str(rest), "--no-fsync"]
    with running_server_process(live, keep=2, args=args) as server:
        with ParamClient(server.address, timeout_s=10) as client:
            client.push(tree(1), 1)
        server.close()  # SIGTERM: a clean stop rests version 1
    assert versions(rest) == ["weights-v000000000001.rlaxw"] and not live.exists()

    with running_server_process(live, keep=2, args=args) as server:
        with ParamClient(server.address, timeout_s=10) as client:
            client.push(tree(2), 2)
            client.push(tree(3), 3)
        server.kill()  # SIGKILL: no stop, nothing copied
    assert versions(rest) == ["weights-v000000000001.rlaxw"]
    assert versions(live) == ["weights-v000000000002.rlaxw", "weights-v000000000003.rlaxw"]

    with running_server_process(live, keep=2, args=args) as server:
        version, got = pulled(server.address)
        assert version == 3, "the restart served the rest folder's older version"
        np.testing.assert_array_equal(got["b"], tree(3)["b"])
    assert versions(rest) == ["weights-v000000000002.rlaxw", "weights-v000000000003.rlaxw"]


def test_spilling_keeps_only_the_newest_and_leaves_a_failed_copy_in_memory(tmp_path: pathlib.Path) -> None:
    live, rest = tmp_path / "live", tmp_path / "rest"
    with running_server(live, keep=3) as address, ParamClient(address, timeout_s=10) as client:
        for version in (1, 2, 3):
            client.push(tree(version), version)
    rest.mkdir()
    (rest / "weights-v000000000001.rlaxw").write_bytes(b"an older run's leftover")
    assert spill_states(live, rest, keep=2, fsync=False) == [2, 3]
    assert versions(rest) == ["weights-v000000000002.rlaxw", "weights-v000000000003.rlaxw"]
    assert not live.exists()

    with running_server(live, keep=3) as address, ParamClient(address, timeout_s=10) as client:
        client.push(tree(4), 4)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the rest folder should be")
    with pytest.raises(OSError):
        spill_states(live, blocked / "rest", keep=2, fsync=False)
    assert versions(live) == ["weights-v000000000004.rlaxw"], "a failed spill lost the only copy"


def test_a_rest_dir_needs_a_state_dir_of_its_own(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="rest_dir.*needs a state_dir"):
        ServerConfig(rest_dir=tmp_path / "rest")
    with pytest.raises(ValueError, match="rest_dir.*must differ from state_dir"):
        ServerConfig(state_dir=tmp_path / "same", rest_dir=tmp_path / "same")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="rest_dir.*is a file"):
        ServerConfig(state_dir=tmp_path / "live", rest_dir=tmp_path / "file")
