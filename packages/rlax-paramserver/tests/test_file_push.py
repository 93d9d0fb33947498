"""A push on the server's host goes through a file: the server creates a staging file in
its state dir, the pusher writes the tensors there, and the commit verifies and renames it.

What is checked: no frame crosses the socket and the version is served from the file;
a pusher that cannot open the file (another host) pushes over the socket and leaves no
file behind; a torn write, a replaced file, an abort, an expired push and a killed
server leave no version and no staging file; frames sent to a file push are refused.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

from rlax_paramserver import ParamClient
from rlax_paramserver.persist import load_newest, state_path, write_staged
from rlax_paramserver.testing import running_server, running_server_process
from rlax_protocol import PushAbort, PushBegin, PushChunks, PushCommit, PushReady, RemoteError, encode_tree


def tree(version: int) -> dict[str, Any]:
    return {
        "w": np.arange(1000, dtype=np.float32) * version,
        "b": {"x": np.full((7, 3), version, dtype=np.int8)},
    }


def staging_files(state_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(state_dir.glob(".weights-v*.tmp-push-*"))


class RecordingClient(ParamClient):
    """A ParamClient that records the operations it pipelined and can rewrite replies."""

    def __init__(self, *args: Any, rewrite: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.operations: list[str] = []
        self.rewrite = rewrite

    def _pipeline(self, requests: Any, operation: str, on_reply: Any, before_send: Any = None) -> None:
        self.operations.append(operation)
        super()._pipeline(requests, operation, on_reply, before_send)

    def _call(self, message: Any, frames: Any = (), **kwargs: Any) -> Any:
        reply = super()._call(message, frames, **kwargs)
        if self.rewrite is not None:
            return dataclasses.replace(reply, message=self.rewrite(reply.message))
        return reply


def test_a_push_on_the_same_host_writes_the_file_and_sends_no_frames(tmp_path) -> None:
    with running_server(tmp_path, keep=2) as address, RecordingClient(address, timeout_s=5) as client:
        committed = [client.push(tree(v), v) for v in (1, 2, 3)]
        pulled = client.pull()
        assert client.stat().versions == (2, 3)
    assert all(c.persisted for c in committed)
    assert "PushChunks" not in client.operations
    assert pulled is not None and pulled.mapped and pulled.version == 3
    assert np.array_equal(pulled.tree["w"], tree(3)["w"])
    assert np.array_equal(pulled.tree["b"]["x"], tree(3)["b"]["x"])
    assert state_path(tmp_path, 3).exists() and state_path(tmp_path, 2).exists()
    assert not state_path(tmp_path, 1).exists()  # pruned beyond keep=2
    assert staging_files(tmp_path) == []


def test_a_pusher_on_another_host_sends_the_frames_and_leaves_no_file(tmp_path) -> None:
    def elsewhere(message: Any) -> Any:  # the named file does not exist where this pusher runs
        if isinstance(message, PushReady) and message.staging_file:
            return msgspec.structs.replace(message, staging_file=str(tmp_path / "gone" / "file"))
        return message

    with (
        running_server(tmp_path) as address,
        RecordingClient(address, timeout_s=5, rewrite=elsewhere) as client,
    ):
        assert client.push(tree(1), 1).persisted
        pulled = client.pull()
        assert client.stat().pending_pushes == 0
    assert "PushChunks" in client.operations
    assert pulled is not None and np.array_equal(pulled.tree["w"], tree(1)["w"])
    assert staging_files(tmp_path) == []


def begin_file_push(client: ParamClient, version: int) -> tuple[PushReady, Any]:
    encoded = encode_tree(tree(version))
    reply = client._call(PushBegin(version=version, manifest=encoded.manifest, local=True), expect=PushReady)
    ready = reply.message
    assert isinstance(ready, PushReady) and ready.staging_file
    return ready, encoded


def test_a_torn_write_is_refused_and_the_server_keeps_serving(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        client.push(tree(1), 1)
        ready, encoded = begin_file_push(client, 2)
        # The pusher died half-way: only the first tensor's bytes were written.
        first = encoded.manifest.tensors[0]
        partial = [f if i == 0 else memoryview(bytes(f.nbytes)) for i, f in enumerate(encoded.frames)]
        write_staged(ready.staging_file, ready.data_offset, encoded.manifest, partial)
        with pytest.raises(RemoteError) as refused:
            client._call(PushCommit(ready.push_id), retry=False)
        assert refused.value.code == "checksum" and "fails its checksum" in refused.value.remote_message
        assert first.name not in refused.value.remote_message  # the torn tensor is named, not the good one
        assert client.stat().versions == (1,)
        assert staging_files(tmp_path) == []
        assert client.push(tree(2), 2).persisted  # the same version, pushed whole, commits
        pulled = client.pull()
    assert pulled is not None and np.array_equal(pulled.tree["w"], tree(2)["w"])


def test_a_file_put_in_place_of_the_staging_file_is_never_installed(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        ready, encoded = begin_file_push(client, 1)
        write_staged(ready.staging_file, ready.data_offset, encoded.manifest, encoded.frames)
        staged = pathlib.Path(ready.staging_file)
        twin = staged.with_name("twin")
        twin.write_bytes(staged.read_bytes())  # the same bytes, another file
        os.replace(twin, staged)
        with pytest.raises(RemoteError) as refused:
            client._call(PushCommit(ready.push_id), retry=False)
        assert "not the staging file" in refused.value.remote_message
        assert client.stat().versions == ()
    assert not state_path(tmp_path, 1).exists()


def test_frames_sent_to_a_file_push_are_refused(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        ready, encoded = begin_file_push(client, 1)
        with pytest.raises(RemoteError) as refused:
            client._call(PushChunks(ready.push_id, 0, 1), [encoded.frames[0]], retry=False)
        assert refused.value.code == "malformed" and "staging file" in refused.value.remote_message
        assert client.push(tree(1), 1).persisted  # the server goes on serving


def test_an_aborted_or_expired_file_push_leaves_no_file(tmp_path) -> None:
    with (
        running_server(tmp_path, push_idle_timeout_s=0.3) as address,
        ParamClient(address, timeout_s=5) as client,
    ):
        ready, _ = begin_file_push(client, 1)
        client._call(PushAbort(ready.push_id))
        assert staging_files(tmp_path) == []
        begin_file_push(client, 2)
        assert len(staging_files(tmp_path)) == 1
        # The server's sweep drops the idle push; the deadline only bounds a hang.
        deadline = time.monotonic() + 120
        while client.stat().pending_pushes != 0:  # expired...
            assert time.monotonic() < deadline, "the idle push never expired"
            time.sleep(0.05)
        assert staging_files(tmp_path) == []  # ...with its file


def test_staging_files_do_not_outlive_the_server(tmp_path) -> None:
    with running_server(tmp_path) as address, ParamClient(address, timeout_s=5) as client:
        begin_file_push(client, 1)
        load_newest(tmp_path)  # a reader (`rlax eval` on a live run) leaves a push in progress alone
        assert len(staging_files(tmp_path)) == 1
    assert staging_files(tmp_path) == []  # a stopped server removes them
    with running_server_process(tmp_path) as server, ParamClient(server.address, timeout_s=5) as client:
        begin_file_push(client, 1)
        server.kill()  # a crash removes nothing...
    assert len(staging_files(tmp_path)) == 1
    with running_server_process(tmp_path) as server, ParamClient(server.address, timeout_s=5) as client:
        assert staging_files(tmp_path) == []  # ...the next start does
        assert client.push(tree(1), 1).persisted
