"""Malformed, unknown, oversized and out-of-order input: an error reply, and the server keeps serving."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
from paramserver_raw_peer import RawPeer

import rlax_protocol as rp
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol.fuzzing import deep_nesting
from rlax_protocol.transport import pack_request_id

SMALL = {"w": np.arange(64, dtype=np.float32), "b": np.arange(3, dtype=np.int32)}


def manifest_of(tree: dict, *, bad_checksum: bool = False) -> tuple[rp.TensorManifest, list[bytes]]:
    encoded = rp.encode_tree(tree, chunk_bytes=64)
    manifest = encoded.manifest
    if bad_checksum:
        first = manifest.tensors[0]
        broken = rp.TensorHeader(first.name, first.dtype, first.shape, first.nbytes, first.checksum ^ 1)
        manifest = rp.TensorManifest(
            manifest.protocol_version, manifest.chunk_bytes, (broken, *manifest.tensors[1:])
        )
    return manifest, [bytes(f) for f in encoded.frames]


NOT_REQUESTS = [
    rp.Welcome(protocol_version=1),
    rp.Ack(),
    rp.Committed(version=1, persisted=True),
    rp.TensorHeader(name="x", dtype="int8", shape=(1,), nbytes=1, checksum=0),
    rp.GenerateRequest(request_id="r", prompt_token_ids=(1,), sampling=rp.SamplingParams(max_tokens=1)),
    rp.Rollout(
        prompt_id="p",
        group_index=0,
        prompt_token_ids=(1,),
        completion_token_ids=(),
        worker_logprobs=(),
        policy_version=0,
    ),
    rp.VerifyResult(request_id="v", reward=0.0, correct=False),
    rp.LatestVersion(version=3),
]


def fuzz_message(rng: random.Random, push_id: int) -> list[bytes]:
    """One hostile multipart message (after the ROUTER identity)."""
    kind = rng.randrange(11)
    rid = pack_request_id(rng.randrange(2**64))
    if kind == 0:  # random bytes, random part counts
        return [rng.randbytes(rng.randrange(0, 48)) for _ in range(rng.randrange(1, 5))]
    if kind == 1:  # a well-formed message that is not a request
        return [rid, rp.encode(rng.choice(NOT_REQUESTS))]
    if kind == 2:  # truncated frame list: the header promises more frames than follow
        return [
            rid,
            rp.encode(rp.PushChunks(push_id=push_id, first_frame=0, count=rng.randrange(2, 9))),
            b"\x00" * 64,
        ]
    if kind == 3:  # absurd sizes
        shape = (2**40, 2**21)
        header = rp.TensorHeader(name="huge", dtype="float32", shape=shape, nbytes=4 * 2**61, checksum=0)
        choices = [
            rp.PushBegin(
                version=10**6,
                manifest=rp.TensorManifest(protocol_version=1, chunk_bytes=1 << 20, tensors=(header,)),
            ),
            rp.PushBegin(
                version=10**6, manifest=rp.TensorManifest(protocol_version=1, chunk_bytes=2**62, tensors=())
            ),
            rp.PushBegin(  # a modest size cut into billions of one-byte frames
                version=10**6,
                manifest=rp.TensorManifest(
                    protocol_version=1,
                    chunk_bytes=1,
                    tensors=(
                        rp.TensorHeader(name="t", dtype="uint8", shape=(2**33,), nbytes=2**33, checksum=0),
                    ),
                ),
            ),
            rp.FetchChunks(lease_id=rng.randrange(2**63), first_frame=0, count=2**62),
            rp.PushChunks(push_id=push_id, first_frame=2**60, count=1),
        ]
        message = rng.choice(choices)
        return [rid, rp.encode(message), *([b"x"] if isinstance(message, rp.PushChunks) else [])]
    if kind == 4:  # out of order: unknown pushes and leases, commit before all chunks
        choices = [
            rp.PushCommit(push_id=rng.randrange(10**6, 10**9)),
            rp.PushCommit(push_id=push_id),
            rp.PushChunks(push_id=rng.randrange(10**6, 10**9), first_frame=0, count=0),
            rp.FetchChunks(lease_id=rng.randrange(10**6, 10**9), first_frame=0, count=1),
            rp.PullBegin(version=rng.randrange(10**6, 10**9)),
        ]
        return [rid, rp.encode(rng.choice(choices))]
    if kind == 5:  # wrong-sized frame for a real pending push
        return [
            rid,
            rp.encode(rp.PushChunks(push_id=push_id, first_frame=0, count=1)),
            rng.randbytes(rng.choice([0, 1, 63, 65])),
        ]
    if kind == 6:  # msgpack with wrong field types or unknown tags
        bad = rng.choice(
            [
                {"type": "PullBegin", "version": "latest"},
                {"type": "PushBegin", "version": -1, "manifest": {}},
                {"type": "DropEverything"},
                {"type": "FetchChunks", "lease_id": 2**64 - 1, "first_frame": -(2**63), "count": 1.5},
                [1, 2, 3],
            ]
        )
        return [rid, msgspec.msgpack.encode(bad)]
    if kind == 9:  # deep nesting, bare or inside a valid push's free-form metadata (issue 12)
        deep = deep_nesting(rng.choice((33, 3000, 100_000)), header=rng.choice((b"\x91", b"\x81\xa1a")))
        if rng.random() < 0.5:
            return [rid, deep]
        manifest = rp.TensorManifest(protocol_version=1, chunk_bytes=64, tensors=())
        push = rp.encode(rp.PushBegin(version=10**6, manifest=manifest, metadata={"k": "HOLE"}))
        return [rid, push.replace(msgspec.msgpack.encode("HOLE"), deep)]
    if kind == 10:  # a length prefix claiming gigabytes, inside a valid message or alone
        huge = rng.choice((b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff"))
        valid = rp.encode(rp.PullBegin(version=None, if_newer_than=10**9))
        at = rng.randrange(len(valid))
        return [rid, rng.choice((huge, valid[:at] + huge + valid[at:]))]
    if kind == 7:  # bad request-id frame
        return [rng.randbytes(rng.choice([0, 3, 9])), rp.encode(rp.LatestQuery())]
    return [rid, rp.encode(rp.PullBegin(version=None, if_newer_than=10**9))]  # valid, answered NotNewer


def test_ten_thousand_hostile_messages_then_correct_pulls() -> None:
    rng = random.Random(1234)
    with running_server(keep=2) as address, ParamClient(address, timeout_s=10) as client:
        client.push(SMALL, 1, {"ok": True})
        peer = RawPeer(address)
        manifest, frames = manifest_of({"p": np.zeros(300, np.uint8)})
        ready = peer.request([rp.encode(rp.PushBegin(version=50, manifest=manifest))])
        assert isinstance(ready, rp.PushReady)
        replies: dict[str, int] = {}
        try:
            for _ in range(10_000):
                peer.send(fuzz_message(rng, ready.push_id))
                _, message, _ = peer.reply()
                name = message.code if isinstance(message, rp.ErrorReply) else type(message).__name__
                replies[name] = replies.get(name, 0) + 1
        finally:
            peer.close()
        assert {"malformed", "unknown_message", "out_of_order", "too_large", "not_found"} <= set(replies), (
            replies
        )
        assert "internal" not in replies, replies
        stats = client.stat()
        assert stats.malformed_messages > 1000 and stats.versions == (1,)
        pulled = client.pull()
        assert pulled is not None and pulled.version == 1 and pulled.metadata == {"ok": True}
        assert np.array_equal(pulled.tree["w"], SMALL["w"]) and np.array_equal(pulled.tree["b"], SMALL["b"])
        client.push({"w": np.ones(4, np.float32)}, 2)
        assert client.latest() == 2


def test_bad_checksum_push_is_refused_and_never_visible() -> None:
    with running_server() as address, ParamClient(address, timeout_s=5) as client:
        peer = RawPeer(address)
        try:
            manifest, frames = manifest_of({"layer": np.arange(100, dtype=np.float32)}, bad_checksum=True)
            ready = peer.request([rp.encode(rp.PushBegin(version=1, manifest=manifest))])
            # The message completing the corrupt tensor is refused at once and the push dropped ...
            reply = peer.request([rp.encode(rp.PushChunks(ready.push_id, 0, len(frames)))], frames)
            assert (
                isinstance(reply, rp.ErrorReply) and reply.code == "checksum" and "'layer'" in reply.message
            )
            # ... so it can never be committed.
            reply = peer.request([rp.encode(rp.PushCommit(ready.push_id))])
            assert isinstance(reply, rp.ErrorReply) and reply.code == "out_of_order"
            assert client.latest() is None and client.stat().pending_pushes == 0
            # Commit before every frame arrived is out of order; nothing becomes visible either.
            manifest, frames = manifest_of({"layer": np.arange(100, dtype=np.float32)})
            ready = peer.request([rp.encode(rp.PushBegin(version=1, manifest=manifest))])
            peer.request([rp.encode(rp.PushChunks(ready.push_id, 0, 1))], frames[:1])
            reply = peer.request([rp.encode(rp.PushCommit(ready.push_id))])
            assert (
                isinstance(reply, rp.ErrorReply)
                and reply.code == "out_of_order"
                and "misses" in reply.message
            )
            assert client.latest() is None and client.stat().pending_pushes == 1
            # The push stays pending: once the rest arrives, the commit succeeds.
            peer.request([rp.encode(rp.PushChunks(ready.push_id, 1, len(frames) - 1))], frames[1:])
            assert peer.request([rp.encode(rp.PushCommit(ready.push_id))]) == rp.Committed(
                version=1, persisted=False
            )
            pulled = client.pull()
            assert pulled is not None and np.array_equal(
                pulled.tree["layer"], np.arange(100, dtype=np.float32)
            )
        finally:
            peer.close()


def test_requests_before_hello_need_the_handshake() -> None:
    with running_server() as address:
        peer = RawPeer(address, hello=False)
        try:
            reply = peer.request([rp.encode(rp.LatestQuery())])
            assert isinstance(reply, rp.ErrorReply) and reply.code == "handshake_required"
        finally:
            peer.close()


def test_oversized_frame_drops_that_connection_only() -> None:
    with running_server(max_frame_bytes=1 << 20) as address, ParamClient(address, timeout_s=5) as client:
        client.push(SMALL, 1)
        peer = RawPeer(address)
        try:
            peer.send([pack_request_id(1), rp.encode(rp.LatestQuery()), b"\x00" * (2 << 20)])
            with pytest.raises(AssertionError, match="did not answer"):
                peer.reply(timeout_ms=500)
        finally:
            peer.close()
        with pytest.raises(rp.RemoteError, match="too_large"):
            client.push({"big": np.zeros(3 << 20, np.uint8)}, 2)  # chunk larger than the server's frame limit
        pulled = client.pull()
        assert pulled is not None and pulled.version == 1
