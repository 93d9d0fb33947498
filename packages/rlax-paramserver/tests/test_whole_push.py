"""A version that fits one message is pushed and committed in one exchange
(`PushBegin.whole`), once the client knows the server's limits from a first push; what a
whole push carries is checked as its three-message form is (frames, sizes, checksums), and
nothing of a refused one stays pending."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from paramserver_raw_peer import RawPeer

import rlax_protocol as rp
from rlax_paramserver import ParamClient, StaleVersionError
from rlax_paramserver.testing import running_server
from rlax_protocol import encode_tree


def tree(version: int) -> dict[str, Any]:
    return {"w": np.arange(3000, dtype=np.float32) * version, "b": {"x": np.full((7, 3), version, np.int8)}}


class CountingClient(ParamClient):
    """Records the type of every message it sends by `_call` (the pipelined chunks aside)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    def _call(self, message: Any, frames: Any = (), **kwargs: Any) -> Any:
        whole = " whole" if isinstance(message, rp.PushBegin) and message.whole else ""
        self.sent.append(type(message).__name__ + whole)
        return super()._call(message, frames, **kwargs)


@pytest.mark.parametrize("persist", [False, True])
def test_after_a_first_push_a_small_version_goes_in_one_exchange(tmp_path, persist: bool) -> None:
    with (
        running_server(tmp_path if persist else None) as address,
        CountingClient(address, timeout_s=10, local=False) as client,  # over the socket
    ):
        first = client.push(tree(1), 1)
        assert client.sent == ["PushBegin", "PushCommit"]  # the limits come with PushReady
        client.sent.clear()
        second = client.push(tree(2), 2, {"step": 2})
        assert client.sent == ["PushBegin whole"]
        pulled = client.pull()
        with pytest.raises(StaleVersionError):  # a whole push is refused as any other
            client.push(tree(2), 2)
        stat = client.stat()
    assert first.persisted is persist and second.persisted is persist and second.version == 2
    assert pulled is not None and pulled.version == 2 and pulled.metadata == {"step": 2}
    assert np.array_equal(pulled.tree["w"], tree(2)["w"]) and np.array_equal(
        pulled.tree["b"]["x"], tree(2)["b"]["x"]
    )
    assert stat.pending_pushes == 0 and stat.latest == 2


def test_a_version_larger_than_the_servers_message_limit_goes_in_parts() -> None:
    with (
        running_server(max_message_bytes=8 * 1024) as address,
        CountingClient(address, timeout_s=10, chunk_bytes=4096) as client,
    ):
        for version in (1, 2):
            client.push(tree(version), version)  # 12 KB of floats: more than one message
        assert "PushBegin whole" not in client.sent and client.sent.count("PushCommit") == 2
        pulled = client.pull()
    assert pulled is not None and np.array_equal(pulled.tree["w"], tree(2)["w"])


def test_a_client_whose_server_lowered_its_limit_falls_back_to_parts() -> None:
    """The limits a client learned are stale (the server restarted with smaller ones): the
    whole push is refused `too_large` before anything is stored, and the same call pushes
    in parts."""
    with (
        running_server(max_message_bytes=8 * 1024) as address,
        CountingClient(address, timeout_s=10, chunk_bytes=4096) as client,
    ):
        client.push(tree(1), 1)
        client._push_limits = (client.address, 1 << 20, 1 << 20)  # what the old server said
        client.sent.clear()
        assert client.push(tree(2), 2).version == 2
        assert client.sent == ["PushBegin whole", "PushBegin", "PushCommit"]
        assert client.stat().pending_pushes == 0


def _whole(version: int) -> tuple[rp.PushBegin, list[bytes]]:
    encoded = encode_tree(tree(version), chunk_bytes=4096)
    return rp.PushBegin(version=version, manifest=encoded.manifest, whole=True), [
        bytes(f) for f in encoded.frames
    ]


@pytest.mark.parametrize(
    ("spoil", "code", "words"),
    [
        ("flip a byte", "checksum", "checksum"),
        ("drop the last frame", "out_of_order", "misses 1 frames"),
        ("add a frame", "out_of_order", "outside push"),
        ("no whole flag", "malformed", "PushBegin takes no frames"),
    ],
)
def test_a_spoiled_whole_push_is_refused_and_leaves_nothing_pending(
    spoil: str, code: str, words: str
) -> None:
    with running_server() as address, ParamClient(address, timeout_s=10) as client:
        client.push(tree(1), 1)
        peer = RawPeer(address)
        try:
            begin, frames = _whole(2)
            if spoil == "flip a byte":
                frames[0] = bytes([frames[0][0] ^ 1]) + frames[0][1:]
            elif spoil == "drop the last frame":
                frames = frames[:-1]
            elif spoil == "add a frame":
                frames = [*frames, b"\0" * 8]
            else:
                begin = rp.PushBegin(version=2, manifest=begin.manifest)
            reply = peer.request([rp.encode(begin)], frames)
            assert isinstance(reply, rp.ErrorReply) and reply.code == code, reply
            assert words in reply.message, reply.message
            again = peer.request(
                [rp.encode(_whole(2)[0])], _whole(2)[1]
            )  # the server serves on; version 2 is free
            assert isinstance(again, rp.Committed) and again.version == 2, again
        finally:
            peer.close()
        stat = client.stat()
    assert stat.pending_pushes == 0 and stat.latest == 2 and stat.versions == (1, 2)


def test_a_whole_push_beyond_the_servers_message_limit_is_too_large() -> None:
    with running_server(max_message_bytes=4096) as address:
        peer = RawPeer(address)
        try:
            begin, frames = _whole(1)
            reply = peer.request([rp.encode(begin)], frames)
            assert isinstance(reply, rp.ErrorReply) and reply.code == "too_large", reply
            assert "max_message_bytes=4096" in reply.message
        finally:
            peer.close()
        with ParamClient(address, timeout_s=10) as client:
            stat = client.stat()
    assert stat.pending_pushes == 0 and stat.latest is None


def test_a_pusher_on_the_servers_host_keeps_writing_staging_files(tmp_path) -> None:
    """`local` pushes go through the state dir's staging files (no frame crosses the socket,
    test_file_push); without a state dir there is no file, and a small version goes whole."""
    with running_server(tmp_path) as address, CountingClient(address, timeout_s=10, local=True) as client:
        for version in (1, 2, 3):
            client.push(tree(version), version)
        assert client.sent == ["PushBegin", "PushCommit"] * 3
    with running_server() as address, CountingClient(address, timeout_s=10, local=True) as client:
        for version in (1, 2):
            client.push(tree(version), version)
        assert client.sent == ["PushBegin", "PushCommit", "PushBegin whole"]
