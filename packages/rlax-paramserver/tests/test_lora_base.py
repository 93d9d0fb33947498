"""Adapter-only versions (`rlax_protocol.lora_versions`): a version that names a base version
is accepted only while the server holds that base, and the base is kept, in memory, on disk,
across a restart and through a rest folder, beyond `keep`, for as long as a held version
names it; pulling such a version costs the adapters' bytes alone."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pytest

from rlax_paramserver import ParamClient
from rlax_paramserver.persist import state_path
from rlax_paramserver.testing import running_server
from rlax_protocol import RemoteError
from rlax_protocol.lora_versions import LORA_BASE_SHA256, LORA_BASE_VERSION, LORA_SCALE, tree_sha256


def base_tree() -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((64, 32)).astype(np.float32),
        "layers": {"q": np.ones((2, 32, 32), np.float32)},
    }


def adapters(version: int) -> dict[str, Any]:
    a = np.full((2, 32, 4), 0.01 * version, np.float32)
    return {"lora": {"q": {"a": a, "b": np.full((2, 4, 32), version, np.float32)}}}


def on_base(base: dict[str, Any], version: int = 0) -> dict[str, Any]:
    return {LORA_BASE_VERSION: version, LORA_BASE_SHA256: tree_sha256(base), LORA_SCALE: 2.0}


def files(folder: pathlib.Path) -> list[str]:
    return sorted(p.name for p in folder.glob("weights-v*.rlaxw"))


def test_the_base_stays_beyond_keep_while_versions_name_it_and_a_pull_costs_the_adapters(
    tmp_path: pathlib.Path,
) -> None:
    base = base_tree()
    with running_server(tmp_path, keep=1) as address, ParamClient(address, timeout_s=10) as client:
        client.push(base, 0, {"step": 0})
        for version in (1, 2, 3):
            client.push(adapters(version), version, {"step": version, **on_base(base)})
        assert client.stat().versions == (0, 3)
        assert files(tmp_path) == [state_path(tmp_path, v).name for v in (0, 3)]
        pulled = client.pull()
        assert pulled is not None and pulled.version == 3
        assert pulled.metadata[LORA_BASE_VERSION] == 0
        assert (
            sum(a.nbytes for a in (pulled.tree["lora"]["q"]["a"], pulled.tree["lora"]["q"]["b"]))
            == 2 * 2 * 32 * 4 * 4
        )
        got_base = client.pull(0)
        assert got_base is not None and tree_sha256(got_base.tree) == pulled.metadata[LORA_BASE_SHA256]
        # A full version names no base: once none held does, the base goes like any old version.
        client.push(base, 4, {"step": 4})
        assert client.stat().versions == (4,)
        assert files(tmp_path) == [state_path(tmp_path, 4).name]


def test_a_restarted_server_and_a_rest_folder_keep_the_base(tmp_path: pathlib.Path) -> None:
    base, live, rest = base_tree(), tmp_path / "live", tmp_path / "rest"
    with running_server(live, keep=1, rest_dir=rest) as address, ParamClient(address, timeout_s=10) as client:
        client.push(base, 0, {"step": 0})
        for version in (1, 2):
            client.push(adapters(version), version, on_base(base))
    assert files(rest) == [state_path(rest, v).name for v in (0, 2)]  # spilled with its base
    with running_server(live, keep=1, rest_dir=rest) as address, ParamClient(address, timeout_s=10) as client:
        stats = client.stat()
        assert stats.versions == (0, 2) and stats.state_error is None
        got = client.pull(0)
        assert got is not None and tree_sha256(got.tree) == tree_sha256(base)
        client.push(adapters(3), 3, on_base(base))  # the restored base still takes new adapters


def test_adapters_on_a_base_the_server_does_not_hold_are_refused(tmp_path: pathlib.Path) -> None:
    base = base_tree()
    with running_server(None, keep=2) as address, ParamClient(address, timeout_s=10) as client:
        with pytest.raises(RemoteError, match="base version 0, which this server does not hold"):
            client.push(adapters(1), 1, on_base(base))
        client.push(base, 0, {})
        client.push(adapters(1), 1, on_base(base))
        client.push(base, 2, {})
        client.push(base, 3, {})  # keep=2: version 1 goes, and with it the reason to keep 0
        assert client.stat().versions == (2, 3)
        with pytest.raises(RemoteError, match="base version 0, which this server does not hold"):
            client.push(adapters(4), 4, on_base(base))
        assert client.stat().versions == (2, 3)


@pytest.mark.parametrize(
    ("metadata", "needle"),
    [
        ({LORA_BASE_VERSION: "0"}, "lora_base_version='0'"),
        ({LORA_BASE_VERSION: 5}, "below the version itself"),
        ({LORA_BASE_VERSION: 0, LORA_BASE_SHA256: "abc", LORA_SCALE: 1.0}, "64 lowercase hex digits"),
        ({LORA_BASE_VERSION: 0, LORA_BASE_SHA256: "a" * 64, LORA_SCALE: 0.0}, "positive number"),
        ({LORA_BASE_VERSION: 0, LORA_BASE_SHA256: "a" * 64, LORA_SCALE: True}, "positive number"),
    ],
)
def test_malformed_lora_metadata_is_refused_by_name(metadata: dict[str, Any], needle: str) -> None:
    with running_server(None) as address, ParamClient(address, timeout_s=10) as client:
        client.push(base_tree(), 0, {})
        with pytest.raises(RemoteError, match=needle):
            client.push(adapters(5), 5, metadata)
        assert client.stat().versions == (0,)
        client.push(adapters(5), 5, on_base(base_tree()))  # and the server goes on serving


def test_a_base_must_be_a_full_version() -> None:
    base = base_tree()
    with running_server(None) as address, ParamClient(address, timeout_s=10) as client:
        client.push(base, 0, {})
        client.push(adapters(1), 1, on_base(base))
        with pytest.raises(RemoteError, match="holds adapters itself"):
            client.push(adapters(2), 2, on_base(base, version=1))
        assert client.stat().versions == (0, 1)
