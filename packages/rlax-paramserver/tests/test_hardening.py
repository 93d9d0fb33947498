"""Issue 12: hostile bytes cannot stop the server; durability; bounded memory under churn."""

from __future__ import annotations

import errno
import threading

import msgspec
import numpy as np
import pytest
import zmq

import rlax_protocol as rp
from rlax_paramserver import ParamClient
from rlax_paramserver import persister as persister_module
from rlax_paramserver import server as server_module
from rlax_paramserver.persist import StateReadError, load_newest, state_path
from rlax_paramserver.testing import running_server
from rlax_protocol.fuzzing import blast, deep_nesting, hostile_requests, request_id_part

SMALL = {"w": np.arange(64, dtype=np.float32), "b": np.arange(3, dtype=np.int32)}


def paramserver_requests(push_id: int, lease_id: int) -> list[bytes]:
    """Encoded requests the server serves, for the fuzzer to mix in and mutate."""
    manifest = rp.encode_tree({"p": np.zeros(300, np.uint8)}, chunk_bytes=64).manifest
    return [
        rp.encode(m)
        for m in (
            rp.LatestQuery(),
            rp.StatQuery(),
            rp.PullBegin(version=None, if_newer_than=10**9),
            rp.PullBegin(prefetch_bytes=1 << 40),
            rp.FetchChunks(lease_id=lease_id, first_frame=0, count=1),
            rp.PushBegin(version=10**6, manifest=manifest, metadata={"step": 1, "nested": {"a": [1]}}),
            rp.PushChunks(push_id=push_id, first_frame=0, count=1),
            rp.PushCommit(push_id=push_id),
            rp.WaitNewer(version=10**9, timeout_ms=1),
        )
    ]


def test_ten_thousand_hostile_requests_with_deep_nesting_then_correct_requests() -> None:
    with running_server(keep=2) as address, ParamClient(address, timeout_s=10) as client:
        client.push(SMALL, 1, {"ok": True})
        with rp.RpcClient(address, timeout_s=10) as rpc:
            manifest = rp.encode_tree({"p": np.zeros(300, np.uint8)}, chunk_bytes=64).manifest
            ready = rpc.call(rp.PushBegin(version=50, manifest=manifest), expect=rp.PushReady).message
            lease = rpc.call(rp.PullBegin(), expect=rp.PullGranted).message
        valid = paramserver_requests(ready.push_id, lease.lease_id)
        requests = list(hostile_requests(10_000, seed=12, valid=valid))
        # The four messages of the issue first: before the fix each killed one of the workers.
        requests[:0] = [[request_id_part(i), b"\x81\xa1a" * 1000 + b"\xc0"] for i in range(8)]
        replies = blast(address, requests, settle_s=2.0)
        assert replies >= 0.99 * len(requests)  # all but the parked long-polls and refused frames
        stats = client.stat()
        assert stats.malformed_messages > 3000 and 1 in stats.versions
        pulled = client.pull(1)
        assert pulled is not None and pulled.metadata == {"ok": True}
        assert np.array_equal(pulled.tree["w"], SMALL["w"])
        client.push({"w": np.ones(4, np.float32)}, 2)
        assert client.latest() == 2


def test_deep_metadata_push_is_refused_and_every_worker_keeps_serving() -> None:
    with running_server(workers=2) as address, ParamClient(address, timeout_s=5, retries=0) as client:
        peer = zmq.Context.instance().socket(zmq.DEALER)
        peer.linger = 0
        peer.connect(address)
        try:
            manifest = rp.TensorManifest(protocol_version=rp.PROTOCOL_VERSION, chunk_bytes=64, tensors=())
            template = rp.encode(rp.PushBegin(version=3, manifest=manifest, metadata={"k": "HOLE"}))
            deep = template.replace(msgspec.msgpack.encode("HOLE"), deep_nesting(5000))
            for n in range(6):  # more than there are workers
                peer.send_multipart([request_id_part(n), deep])
                assert peer.poll(5000), "no answer: a worker died"
                reply = rp.decode(peer.recv_multipart()[1])
                assert isinstance(reply, rp.ErrorReply) and reply.code == "malformed"
        finally:
            peer.close()
        assert client.latest() is None
        client.push(SMALL, 1)
        assert client.latest() == 1


@pytest.mark.parametrize("by_file", [True, False], ids=["pushed-by-file", "pushed-over-the-socket"])
def test_a_failed_persist_is_reported_and_the_persister_lives_on(tmp_path, monkeypatch, by_file) -> None:
    writer = "install_staged" if by_file else "write_state"
    real_write = getattr(persister_module, writer)
    failures = iter([RuntimeError("metadata the disk format cannot hold"), MemoryError()])

    def flaky_write(*args, **kwargs):
        error = next(failures, None)
        if error is not None:
            raise error
        return real_write(*args, **kwargs)

    monkeypatch.setattr(persister_module, writer, flaky_write)
    with (
        running_server(tmp_path) as address,
        ParamClient(address, timeout_s=5, commit_timeout_s=10, local=by_file) as client,
    ):
        for version in (1, 2):
            with pytest.raises(rp.RemoteError, match="persist_failed") as raised:
                client.push(SMALL, version)
            assert raised.value.code == "persist_failed"
        assert client.latest() is None  # never visible, since never on disk
        assert "persisting version 2 failed" in (client.stat().state_error or "")
        committed = client.push(SMALL, 3)
        assert committed == rp.Committed(version=3, persisted=True)
        stats = client.stat()
        assert stats.latest == 3 and stats.persisted_version == 3 and stats.state_error is None


@pytest.mark.parametrize("by_file", [True, False], ids=["pushed-by-file", "pushed-over-the-socket"])
def test_a_version_is_never_visible_before_it_is_on_disk(tmp_path, monkeypatch, by_file) -> None:
    writer = "install_staged" if by_file else "write_state"
    real_write = getattr(persister_module, writer)
    writing, release = threading.Event(), threading.Event()

    def slow_write(*args, **kwargs):
        writing.set()
        assert release.wait(10)
        return real_write(*args, **kwargs)

    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5, local=by_file) as client:
        client.push(SMALL, 1)
        monkeypatch.setattr(persister_module, writer, slow_write)
        result: list[rp.Committed] = []
        pusher = threading.Thread(target=lambda: result.append(client.push(SMALL, 2)))
        pusher.start()
        try:
            assert writing.wait(10)
            with ParamClient(address, timeout_s=5) as puller:
                # Being written: not yet served, and not pushable again either.
                assert puller.latest() == 1
                pulled = puller.pull()
                assert pulled is not None and pulled.version == 1
                assert load_newest(tmp_path)[0].version == 1  # type: ignore[union-attr]
                with pytest.raises(rp.RemoteError, match="being committed"):
                    puller.push(SMALL, 2)
        finally:
            release.set()
            pusher.join(10)
        assert result == [rp.Committed(version=2, persisted=True)]
        assert client.latest() == 2
    # What pullers saw is what a restart serves.
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        assert client.latest() == 2


def test_unreadable_state_file_is_not_renamed_corrupt(tmp_path, monkeypatch) -> None:
    from rlax_paramserver import persist

    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push(SMALL, 4)
    path = state_path(tmp_path, 4)
    good = path.read_bytes()

    def failing_read(p):
        raise OSError(errno.EIO, "Input/output error", str(p))

    monkeypatch.setattr(persist, "read_state", failing_read)
    with pytest.raises(StateReadError, match=f"cannot read state file {path}.*Input/output"):
        load_newest(tmp_path)
    with pytest.raises(StateReadError), running_server(tmp_path):
        pass
    assert path.read_bytes() == good and not list(tmp_path.glob("*.corrupt"))
    monkeypatch.undo()
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        assert client.latest() == 4


def _reconnect(address: str, client_id: str, *messages: rp.Message) -> list[rp.Message]:
    """One short-lived connection: Hello as `client_id`, send `messages`, read the replies
    that come within a moment, close (a new ZeroMQ identity every time)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(address)
    replies: list[rp.Message] = []
    try:
        hello = rp.Hello(protocol_version=rp.PROTOCOL_VERSION, client_id=client_id)
        socket.send_multipart([request_id_part(0), rp.encode(hello)])
        assert socket.poll(5000)
        assert isinstance(rp.decode(socket.recv_multipart()[1]), rp.Welcome)
        for n, message in enumerate(messages, 1):
            socket.send_multipart([request_id_part(n), rp.encode(message)])
            if not isinstance(message, rp.WaitNewer):
                assert socket.poll(5000)
                replies.append(rp.decode(socket.recv_multipart()[1]))
    finally:
        socket.close(0)
    return replies


def test_reconnect_churn_keeps_clients_waiters_pushes_and_leases_bounded() -> None:
    manifest = rp.encode_tree({"p": np.zeros(300, np.uint8)}, chunk_bytes=64).manifest
    limits = {"max_clients": 50, "max_waiters": 40, "max_leases": 60}
    with running_server(**limits) as address, ParamClient(address, timeout_s=5) as client:
        client.push(SMALL, 1)  # two tensors: a pull that prefetches one frame keeps its lease
        for n in range(300):
            # The same pusher reconnecting: its older push is abandoned, never `busy`.
            (reply,) = _reconnect(address, "trainer", rp.PushBegin(version=2, manifest=manifest))
            assert isinstance(reply, rp.PushReady), reply
            # A puller reconnecting mid-pull and mid-long-poll: its older lease is ended.
            (grant,) = _reconnect(
                address,
                "puller",
                rp.PullBegin(prefetch_bytes=1),
                rp.WaitNewer(version=1, timeout_ms=60_000),
            )
            assert isinstance(grant, rp.PullGranted), grant
            # Strangers that lease, long-poll and vanish.
            _reconnect(
                address,
                f"stranger-{n}",
                rp.PullBegin(prefetch_bytes=1),
                rp.WaitNewer(version=1, timeout_ms=60_000),
            )
        stats = client.stat()
        assert stats.pending_pushes <= 2
        assert stats.clients <= 50
        assert stats.waiters <= 40
        assert stats.pulls_in_flight <= 60
        client.push(SMALL, 3)  # long-polls are woken, pushes and pulls still work
        assert client.stat().waiters == 0
        assert client.pull().version == 3  # type: ignore[union-attr]


def test_any_exception_in_a_worker_or_the_persister_is_answered_and_both_live_on(
    tmp_path, monkeypatch
) -> None:
    from rlax_paramserver.store import VersionStore

    real_answer, real_install = server_module.ParamServer._answer, VersionStore.install
    broken = {"answer": 1, "install": 1}

    def answer_once_broken(self, socket, request, role=""):
        if isinstance(request.message, rp.LatestQuery) and broken["answer"]:
            broken["answer"] -= 1
            raise RuntimeError("a bug reached by one request")
        return real_answer(self, socket, request, role)

    def install_once_broken(self, stored):
        if broken["install"]:
            broken["install"] -= 1
            raise RuntimeError("a bug in making a version visible")
        return real_install(self, stored)

    monkeypatch.setattr(server_module.ParamServer, "_answer", answer_once_broken)
    monkeypatch.setattr(VersionStore, "install", install_once_broken)
    with (
        running_server(tmp_path, workers=1) as address,
        ParamClient(address, timeout_s=5, retries=0, commit_timeout_s=5) as client,
    ):
        with pytest.raises(rp.RemoteError, match="internal.*a bug reached by one request"):
            client.latest()
        with pytest.raises(rp.RemoteError, match="internal.*a bug in making a version visible"):
            client.push(SMALL, 1)
        assert client.latest() is None  # the single worker still serves
        assert client.push(SMALL, 1) == rp.Committed(version=1, persisted=True)  # so does the persister
        assert client.latest() == 1


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path, monkeypatch) -> None:
    from rlax_paramserver import persist

    def failing_fsync(fd: int) -> None:  # what a full disk reports on a delayed write
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist.os, "fsync", failing_fsync)
    manifest = rp.encode_tree({"w": np.zeros(4, np.float32)}).manifest
    with pytest.raises(OSError, match="No space left"):
        persist.write_state(tmp_path, 1, manifest, {}, [memoryview(bytes(16))])
    assert list(tmp_path.iterdir()) == []
