"""A push of several messages hashes each tensor while the ones before it are on the wire:
its `PushBegin` says `checksums_follow`, the checksums come with `PushCommit`, and the server,
which hashed every tensor on arrival, commits only if each matches. What it then serves and
persists carries the real checksums (a verifying pull and a restart prove it)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from paramserver_raw_peer import RawPeer

import rlax_protocol as rp
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol import encode_tree

SMALL_MESSAGES = {"chunk_bytes": 4096, "message_bytes": 8192}
"""Client settings that split the test tree into several frames and messages."""


def tree(version: int) -> dict[str, Any]:
    return {
        "w": np.arange(3000, dtype=np.float32) * version,
        "big": np.linspace(0, version, 5000, dtype=np.float32),  # 5 frames of 4 KiB
        "b": {"x": np.full((7, 3), version, np.int8)},
    }


class RecordingClient(ParamClient):
    """Keeps every message it sends by `_call` (the pipelined chunks aside)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[rp.Message] = []

    def _call(self, message: Any, frames: Any = (), **kwargs: Any) -> Any:
        self.sent.append(message)
        return super()._call(message, frames, **kwargs)


def begins_and_commits(sent: list[rp.Message]) -> list[rp.Message]:
    return [m for m in sent if isinstance(m, rp.PushBegin | rp.PushCommit)]


def assert_same(pulled: dict[str, Any], expected: dict[str, Any]) -> None:
    assert np.array_equal(pulled["w"], expected["w"]) and np.array_equal(pulled["big"], expected["big"])
    assert np.array_equal(pulled["b"]["x"], expected["b"]["x"])


@pytest.mark.parametrize("persist", [False, True])
def test_a_client_that_is_not_local_sends_its_checksums_with_the_commit(tmp_path, persist: bool) -> None:
    state = tmp_path / "state" if persist else None
    with (
        running_server(state) as address,
        RecordingClient(address, timeout_s=10, local=False, **SMALL_MESSAGES) as client,
    ):
        committed = client.push(tree(2), 2)
        begin, commit = begins_and_commits(client.sent)
        pulled = client.pull()  # verifies every tensor against the manifest the server serves
    assert begin.checksums_follow and all(t.checksum == 0 for t in begin.manifest.tensors)
    expected = encode_tree(tree(2), chunk_bytes=SMALL_MESSAGES["chunk_bytes"]).manifest
    assert commit.checksums == tuple(t.checksum for t in expected.tensors)
    assert committed.version == 2 and committed.persisted is persist
    assert pulled is not None and pulled.version == 2
    assert_same(pulled.tree, tree(2))
    if persist:  # the file holds the real checksums: a restarted server loads and serves it
        with (
            running_server(state) as address,
            ParamClient(address, timeout_s=10) as client,
        ):
            restored = client.pull()
        assert restored is not None and restored.version == 2
        assert_same(restored.tree, tree(2))


def test_a_local_client_streams_once_the_server_named_no_staging_file() -> None:
    """A `local` client does not know before its first push whether the server stages
    files for it; that push carries its checksums, the next ones (no file offered) stream."""
    with (
        running_server() as address,  # no state dir: no staging files
        RecordingClient(address, timeout_s=10, local=True, **SMALL_MESSAGES) as client,
    ):
        client.push(tree(1), 1)
        first_begin, first_commit = begins_and_commits(client.sent)
        client.sent.clear()
        client.push(tree(2), 2)
        begin, commit = begins_and_commits(client.sent)
        pulled = client.pull()
    assert not first_begin.checksums_follow and first_begin.local and first_commit.checksums == ()
    assert all(t.checksum != 0 for t in first_begin.manifest.tensors)
    assert begin.checksums_follow and not begin.local and len(commit.checksums) == 3
    assert pulled is not None and pulled.version == 2
    assert_same(pulled.tree, tree(2))


def test_a_streaming_push_on_the_servers_host_is_given_no_staging_file(tmp_path) -> None:
    """A client that is `local` pushes by file once the server offers one; a push that
    says `checksums_follow` (sent by hand here) is never given a file: its manifest has no
    checksums to write into the file's header."""
    with running_server(tmp_path) as address:
        peer = RawPeer(address)
        try:
            manifest = encode_tree(tree(1), checksums=False).manifest
            ready = peer.request(
                [rp.encode(rp.PushBegin(version=1, manifest=manifest, local=True, checksums_follow=True))]
            )
        finally:
            peer.close()
    assert isinstance(ready, rp.PushReady) and ready.staging_file == ""


def _streamed_push(peer: RawPeer, version: int, value: dict[str, Any]) -> tuple[int, list[int]]:
    """Begin a `checksums_follow` push of `value` and send all its frames; its push id and
    the true checksums."""
    encoded = encode_tree(value, checksums=False)
    begin = rp.PushBegin(version=version, manifest=encoded.manifest, checksums_follow=True)
    ready = peer.request([rp.encode(begin)])
    assert isinstance(ready, rp.PushReady)
    frames = [bytes(f) for f in encoded.frames]
    chunks = rp.PushChunks(ready.push_id, 0, len(frames))
    assert isinstance(peer.request([rp.encode(chunks)], frames), rp.Ack)
    true = [t.checksum for t in encode_tree(value).manifest.tensors]
    return ready.push_id, true


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("one checksum wrong", "checksum"),
        ("one checksum missing", "malformed"),
        ("no checksums", "malformed"),
        ("a hundred thousand checksums", "malformed"),  # well-formed, asks for far too much
    ],
)
def test_a_commit_whose_checksums_do_not_match_is_refused_and_the_server_serves_on(
    case: str, code: str
) -> None:
    with running_server() as address, ParamClient(address, timeout_s=10) as client:
        client.push(tree(1), 1)
        peer = RawPeer(address)
        try:
            push_id, checksums = _streamed_push(peer, 2, tree(2))
            if case == "one checksum wrong":
                checksums[1] ^= 1  # tensor 1 of the sorted manifest: 'big'
            elif case == "one checksum missing":
                checksums.pop()
            elif case == "a hundred thousand checksums":
                checksums = checksums * 33_334
            else:
                checksums = []
            reply = peer.request([rp.encode(rp.PushCommit(push_id, checksums=tuple(checksums)))])
            # The push is gone with its refusal: committing it again is out of order.
            again = peer.request([rp.encode(rp.PushCommit(push_id, checksums=tuple(checksums)))])
        finally:
            peer.close()
        stat = client.stat()
        pulled = client.pull()
        client.push(tree(3), 3)  # the version refused is free again for the next push
        latest = client.latest()
    assert isinstance(reply, rp.ErrorReply) and reply.code == code, reply
    if code == "checksum":
        assert "'big'" in reply.message
    assert isinstance(again, rp.ErrorReply) and again.code == "out_of_order"
    assert stat.latest == 1 and stat.pending_pushes == 0
    assert pulled is not None and pulled.version == 1 and latest == 3


def test_checksums_sent_with_the_commit_of_a_push_that_had_them_are_refused() -> None:
    with running_server() as address:
        peer = RawPeer(address)
        try:
            encoded = encode_tree(tree(1))
            ready = peer.request([rp.encode(rp.PushBegin(version=1, manifest=encoded.manifest))])
            assert isinstance(ready, rp.PushReady)
            frames = [bytes(f) for f in encoded.frames]
            peer.request([rp.encode(rp.PushChunks(ready.push_id, 0, len(frames)))], frames)
            checksums = tuple(t.checksum for t in encoded.manifest.tensors)
            reply = peer.request([rp.encode(rp.PushCommit(ready.push_id, checksums=checksums))])
            latest = peer.request([rp.encode(rp.LatestQuery())])
        finally:
            peer.close()
    assert isinstance(reply, rp.ErrorReply) and reply.code == "malformed"
    assert "sent them in its manifest" in reply.message
    assert isinstance(latest, rp.LatestVersion) and latest.version is None


def test_a_frame_resent_after_its_tensor_was_hashed_is_hashed_again() -> None:
    """A tensor's hash taken on arrival belongs to those frames: when a frame of it comes
    again with other bytes (a resend), the commit compares the new bytes, not the old hash."""
    with running_server() as address:
        peer = RawPeer(address)
        try:
            value = tree(2)
            push_id, checksums = _streamed_push(peer, 1, value)
            encoded = encode_tree(value, checksums=False)
            index = next(i for i, t in enumerate(encoded.manifest.tensors) if t.name == "b/x")
            first = sum(encoded.manifest.frames_per_tensor()[:index])
            corrupt = bytearray(encoded.frames[first])
            corrupt[0] ^= 0xFF
            resend = rp.PushChunks(push_id, first, 1)
            assert isinstance(peer.request([rp.encode(resend)], [bytes(corrupt)]), rp.Ack)
            reply = peer.request([rp.encode(rp.PushCommit(push_id, checksums=tuple(checksums)))])
        finally:
            peer.close()
    assert isinstance(reply, rp.ErrorReply) and reply.code == "checksum" and "'b/x'" in reply.message
