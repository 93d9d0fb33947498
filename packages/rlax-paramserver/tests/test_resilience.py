"""Clients survive a server restart and never hang on a dead one."""

from __future__ import annotations

import time

import pytest

import rlax_protocol as rp
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server_process
from rlax_protocol.ports import reserve_port


def free_port() -> int:
    return reserve_port()


def test_client_rides_through_a_server_restart(tmp_path, stamp) -> None:
    make, check = stamp
    port = free_port()
    bind = ["--bind", f"tcp://127.0.0.1:{port}"]
    with ParamClient(f"tcp://127.0.0.1:{port}", timeout_s=2, retries=5, backoff_s=0.1) as client:
        with running_server_process(tmp_path, args=bind):
            client.push(make(1), 1)
        # The server is gone: a call times out after its bounded retries, naming peer and operation.
        started = time.monotonic()
        with ParamClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2, retries=2, backoff_s=0.01) as impatient:
            with pytest.raises(
                rp.ProtocolTimeoutError, match=rf"LatestQuery.*127\.0\.0\.1:{port}.*3 attempts"
            ):
                impatient.latest()
        assert time.monotonic() - started < 30
        with running_server_process(tmp_path, args=bind):
            # Same client object: it reconnects and says Hello to the new server by itself.
            assert client.latest() == 1
            pulled = client.pull()
            assert pulled is not None
            check(pulled.tree, 1)
            client.push(make(2), 2)
            assert client.stat().versions == (1, 2)


def test_a_client_follows_a_server_that_moved_to_another_address(tmp_path, stamp) -> None:
    """Issue 29: a parameter server restarted on another node listens elsewhere; the client's
    `resolve` (the run's address book) names the new address. The same client reaches it:
    its wait on the old address ends within a second of the book naming the new one, not
    after its 30 s timeout, and nobody restarts its process."""
    make, check = stamp
    first, second = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    book = {"paramserver": first}
    with ParamClient(first, timeout_s=30, retries=3, resolve=lambda: book["paramserver"]) as client:
        with running_server_process(tmp_path, args=["--bind", first]):
            client.push(make(1), 1)
        with running_server_process(tmp_path, args=["--bind", second]):  # same state folder
            book["paramserver"] = second
            started = time.monotonic()
            assert client.latest() == 1
            assert time.monotonic() - started < client.timeout_s
            assert client.address == second
            pulled = client.pull()
            assert pulled is not None
            check(pulled.tree, 1)
            client.push(make(2), 2)


def test_pull_and_push_resend_only_unanswered_requests_after_a_timeout(stamp, monkeypatch) -> None:
    """A timeout in the middle of a pipelined push or pull resends exactly what is unanswered."""
    from rlax_paramserver.testing import running_server

    make, check = stamp
    with running_server() as address:
        client = ParamClient(address, timeout_s=5, chunk_bytes=1024, message_bytes=4096, window=3)
        rpc = client._rpc
        original = rpc.recv_reply
        calls = {"n": 0}

        def flaky(pending, *, timeout_s, operation):
            calls["n"] += 1
            if calls["n"] in (3, 7):  # lose the connection twice, with requests in flight
                raise rp.ProtocolTimeoutError(rpc.peer, f"receive {operation}", timeout_s)
            return original(pending, timeout_s=timeout_s, operation=operation)

        monkeypatch.setattr(rpc, "recv_reply", flaky)
        client.push(make(3, layers=4), 3)
        calls["n"] = 0
        pulled = client.pull()
        assert pulled is not None and pulled.version == 3
        check(pulled.tree, 3)
        monkeypatch.undo()
        assert client.stat().pending_pushes == 0
        client.close()
