"""Persistence of the newest versions: restart, kill -9 mid-push, corrupt state files."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_paramserver import ParamClient, VersionNotFoundError
from rlax_paramserver.persist import state_path
from rlax_paramserver.testing import running_server, running_server_process
from rlax_protocol import PushBegin, PushChunks, PushReady, RpcClient, encode_tree


def test_restarted_server_serves_the_newest_version(tmp_path, stamp) -> None:
    make, check = stamp
    with running_server(tmp_path, keep=2) as address, ParamClient(address, timeout_s=5) as client:
        for version in (1, 2, 3):
            assert client.push(make(version), version, {"v": version}).persisted
    # The newest `keep` versions stay on disk (test_persist_keep.py covers this in depth).
    assert sorted(p.name for p in tmp_path.iterdir()) == [state_path(tmp_path, v).name for v in (2, 3)]
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        stats = client.stat()
        assert stats.versions == (2, 3) and stats.persisted_version == 3 and stats.state_error is None
        pulled = client.pull()
        assert pulled is not None and pulled.version == 3 and pulled.metadata == {"v": 3}
        check(pulled.tree, 3)
        with pytest.raises(Exception, match="not newer"):
            client.push(make(3), 3)
        client.push(make(4), 4)


def test_kill_9_mid_push_then_restart_serves_last_committed(tmp_path, stamp) -> None:
    make, check = stamp
    with running_server_process(tmp_path) as server:
        with ParamClient(server.address, timeout_s=10) as client:
            assert client.push(make(1), 1, {"v": 1}).persisted
        # Half of version 2's frames, then the server dies without warning.
        encoded = encode_tree(make(2, layers=8, hidden=64), chunk_bytes=2048)
        with RpcClient(server.address, timeout_s=10) as rpc:
            ready = rpc.call(
                PushBegin(version=2, manifest=encoded.manifest, metadata={"v": 2}), expect=PushReady
            ).message
            half = len(encoded.frames) // 2
            for index in range(half):
                rpc.call(PushChunks(ready.push_id, index, 1), [encoded.frames[index]])
            with ParamClient(server.address, timeout_s=10) as probe:
                assert probe.stat().pending_pushes == 1
            server.kill()
        assert server.process.returncode == -9
    with running_server_process(tmp_path) as server, ParamClient(server.address, timeout_s=10) as client:
        assert client.latest() == 1
        assert client.stat().versions == (1,)
        pulled = client.pull()
        assert pulled is not None and pulled.version == 1 and pulled.metadata == {"v": 1}
        check(pulled.tree, 1)
        with pytest.raises(VersionNotFoundError):
            client.pull(2)


@pytest.mark.parametrize("damage", ["flip_data", "truncate", "garbage_header"])
def test_corrupt_state_is_detected_reported_and_not_served(tmp_path, stamp, damage: str) -> None:
    make, _ = stamp
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push(make(7), 7)
    path = state_path(tmp_path, 7)
    data = bytearray(path.read_bytes())
    if damage == "flip_data":
        data[-100] ^= 0x01
    elif damage == "truncate":
        del data[-10:]
    else:
        data[12:40] = b"\xff" * 28
    path.write_bytes(bytes(data))
    (tmp_path / ".weights-v000000000008.rlaxw.tmp-999").write_bytes(b"half written")
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        stats = client.stat()
        assert stats.versions == () and stats.latest is None
        assert stats.state_error is not None and path.name in stats.state_error
        with pytest.raises(VersionNotFoundError):
            client.pull()
        # The server still works: a new version commits and persists.
        assert client.push(make(8), 8).persisted
    assert not list(tmp_path.glob(".*tmp*"))
    assert (tmp_path / (path.name + ".corrupt")).exists()


def test_flipped_data_byte_names_the_tensor(tmp_path) -> None:
    from rlax_paramserver.persist import CorruptStateError, read_state

    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push({"a": np.zeros(1000, np.float32), "b": np.ones(1000, np.float32)}, 1)
    path = state_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80  # last byte belongs to tensor "b"
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="tensor 'b'"):
        read_state(path)


def test_kill_9_right_after_a_puller_saw_a_version_never_goes_backwards(tmp_path) -> None:
    import threading

    from rlax_protocol import ProtocolError

    big = {"w": np.full(4 << 20, 2.0, np.float32)}  # 16 MB: its write takes a while
    with running_server_process(tmp_path) as server:
        with (
            ParamClient(server.address, timeout_s=3, retries=0, commit_timeout_s=2) as pusher,
            ParamClient(server.address, timeout_s=5) as watcher,
        ):
            pusher.push({"w": np.ones(4, np.float32)}, 1)

            def push_quietly() -> None:
                try:
                    pusher.push(big, 2)
                except (ProtocolError, OSError):
                    pass  # the server is killed under it

            thread = threading.Thread(target=push_quietly)
            thread.start()
            seen = watcher.wait_for_newer(1, timeout=30)  # woken the moment version 2 is served
            server.kill()
            thread.join(30)
        assert seen == 2
    with running_server_process(tmp_path) as server, ParamClient(server.address, timeout_s=10) as client:
        assert client.latest() == seen
        pulled = client.pull()
        assert pulled is not None and np.array_equal(pulled.tree["w"], big["w"])
