"""One model over two server shards: stable placement, parallel push and pull."""

from __future__ import annotations

import subprocess
import sys

from rlax_paramserver import ParamClient, ShardedParamClient, shard_of
from rlax_paramserver.testing import running_server


def test_two_shards_round_trip(stamp) -> None:
    make, check = stamp
    with running_server() as first, running_server() as second:
        with ShardedParamClient([first, second], timeout_s=10) as sharded:
            assert sharded.latest() is None
            for version in (1, 2):
                sharded.push(make(version, layers=6), version, {"v": version})
            pulled = sharded.pull()
            assert pulled is not None and pulled.version == 2 and pulled.metadata == {"v": 2}
            check(pulled.tree, 2)
            assert sharded.pull(if_newer_than=2) is None
            older = sharded.pull(1)
            assert older is not None
            check(older.tree, 1)
            assert sharded.wait_for_newer(1, 1.0) == 2
            assert [s.versions for s in sharded.stat()] == [(1, 2), (1, 2)]
        # Each shard holds exactly the tensors that hash to it, and both hold some.
        for index, address in enumerate((first, second)):
            with ParamClient(address, timeout_s=5) as direct:
                part = direct.pull()
                assert part is not None
                names = _paths(part.tree)
                assert names and all(shard_of(n, 2) == index for n in names)


def test_placement_is_stable_across_processes() -> None:
    names = ["embed", "layers/0/attn/q", "layers/17/mlp/down"]
    here = [shard_of(n, 4) for n in names]
    code = f"from rlax_paramserver import shard_of; print([shard_of(n, 4) for n in {names!r}])"
    there = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert there.stdout.strip() == str(here)


def _paths(tree: dict, prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        out += _paths(value, path) if isinstance(value, dict) else [path]
    return out
