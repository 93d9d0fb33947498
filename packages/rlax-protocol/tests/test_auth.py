"""The control plane (`rlax_protocol.auth`): only the run's roles connect, each role sends
only what the server lets it, a stranger or an earlier run's process is refused at the
door, and no server listens beyond loopback without authentication unless told to."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

import rlax_protocol as rp
from rlax_protocol.auth import (
    ANY_ROLE,
    Credential,
    InsecureBindError,
    RunKeys,
    is_loopback,
    roles,
)
from rlax_protocol.procfs import memory_mb

PERMISSIONS = {rp.VerifyRequest: roles("controller"), rp.LatestQuery: roles(ANY_ROLE)}


def handler(message: rp.Message, frames: object) -> rp.Message:
    if isinstance(message, rp.LatestQuery):
        return rp.LatestVersion(version=7)
    assert isinstance(message, rp.VerifyRequest)
    return rp.VerifyResult(request_id=message.request_id, reward=1.0, correct=True)


@contextmanager
def server(keys: RunKeys | None, bind: str = "tcp://127.0.0.1:*", **kwargs: object) -> Iterator[rp.RpcServer]:
    credential = keys.credential("server") if keys is not None else None
    srv = rp.RpcServer(
        bind, handler, server_id="guarded", permissions=PERMISSIONS, credential=credential, **kwargs
    )  # type: ignore[arg-type]
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def client(address: str, credential: Credential | None, timeout_s: float = 2.0) -> rp.RpcClient:
    return rp.RpcClient(address, timeout_s=timeout_s, retries=0, credential=credential)


VERIFY = rp.VerifyRequest(request_id="r", verifier="exact_match", completion="a", reference="a")


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
def test_each_role_sends_only_what_the_server_allows(mechanism: str) -> None:
    keys = RunKeys.generate(mechanism)  # type: ignore[arg-type]
    with server(keys) as srv:
        with client(srv.address, keys.credential("controller")) as controller:
            assert controller.call(VERIFY, expect=rp.VerifyResult).message.correct
            assert controller.call(rp.LatestQuery()).message == rp.LatestVersion(version=7)
        with client(srv.address, keys.credential("worker")) as worker:
            assert worker.call(rp.LatestQuery()).message == rp.LatestVersion(version=7)
            with pytest.raises(rp.RemoteError) as refused:
                worker.call(VERIFY)
            assert refused.value.code == "forbidden"
            assert "VerifyRequest" in refused.value.remote_message
            assert "'worker'" in refused.value.remote_message
        assert srv.auth.refused == 1


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
def test_a_stranger_and_an_earlier_runs_process_are_refused_at_the_door(mechanism: str) -> None:
    keys = RunKeys.generate(mechanism)  # type: ignore[arg-type]
    earlier_run = RunKeys.generate(mechanism)  # type: ignore[arg-type]
    with server(keys) as srv:
        for credential in (None, earlier_run.credential("controller")):
            with client(srv.address, credential, timeout_s=1.0) as stranger:
                with pytest.raises(rp.ProtocolTimeoutError):
                    stranger.call(VERIFY)
        # A client that claims a role with another role's... nothing: a made-up token.
        forged = Credential(
            role="controller", mechanism="plain", accepted={}, secret="0" * 64, run_id=keys.run_id
        )
        if mechanism == "plain":
            with (
                client(srv.address, forged, timeout_s=1.0) as impostor,
                pytest.raises(rp.ProtocolTimeoutError),
            ):
                impostor.call(VERIFY)
        with client(srv.address, keys.credential("controller")) as controller:
            assert controller.call(VERIFY, expect=rp.VerifyResult).message.correct
        assert srv.stats["requests"] == 2  # the controller's Hello and request: nothing of the strangers'


def test_an_open_server_refuses_to_listen_beyond_loopback_unless_told() -> None:
    with pytest.raises(InsecureBindError, match="security.insecure"):
        rp.RpcServer("tcp://0.0.0.0:*", handler, server_id="open", credential=None, insecure=False).listen()
    srv = rp.RpcServer("tcp://0.0.0.0:*", handler, server_id="open", insecure=True)
    try:
        assert srv.listen().startswith("tcp://0.0.0.0:")
    finally:
        srv.stop()
    keys = RunKeys.generate("curve")
    with server(keys, bind="tcp://0.0.0.0:*", insecure=False) as srv:  # authenticated: fine
        port = srv.address.rsplit(":", 1)[1]
        with client(f"tcp://127.0.0.1:{port}", keys.credential("controller")) as controller:
            assert controller.call(VERIFY, expect=rp.VerifyResult).message.correct


def test_loopback_addresses() -> None:
    for local in (
        "tcp://127.0.0.1:5",
        "tcp://127.9.9.9:5",
        "tcp://localhost:5",
        "tcp://[::1]:5",
        "ipc:///x",
        "inproc://x",
    ):
        assert is_loopback(local), local
    for remote in (
        "tcp://0.0.0.0:5",
        "tcp://*:5",
        "tcp://10.0.0.5:5",
        "tcp://node-3:5",
        "auto",
        "tcp://[::]:5",
    ):
        assert not is_loopback(remote), remote
    assert RunKeys.for_addresses(["tcp://127.0.0.1:1", "tcp://localhost:2"]).mechanism == "plain"
    assert RunKeys.for_addresses(["tcp://127.0.0.1:1", "tcp://10.1.1.1:2"]).mechanism == "curve"


@pytest.mark.parametrize("mechanism", ["plain", "curve"])
def test_a_credential_holds_only_its_own_roles_secret(mechanism: str) -> None:
    keys = RunKeys.generate(mechanism)  # type: ignore[arg-type]
    worker = keys.credential("worker")
    text = worker.to_json()
    assert Credential.from_json(text) == worker
    for role in ("trainer", "controller"):
        secret = keys.tokens[role] if mechanism == "plain" else keys.client_keys[role][1]
        assert secret not in text
    shown = repr(worker)
    assert (worker.secret or worker.client_secret) not in shown and "worker" in shown
    with pytest.raises(ValueError, match="RLAX_CREDENTIAL"):
        Credential.from_json("[1, 2]")


@pytest.mark.parametrize("keyed", [True, False])
def test_twelve_messages_of_100_mb_are_never_buffered(keyed: bool) -> None:
    """Keyed: the sender never gets past the handshake. Open: ZeroMQ's MAXMSGSIZE drops it
    before buffering. Either way the server's memory does not move and it keeps serving."""
    keys = RunKeys.generate("plain") if keyed else None
    big = os.urandom(100 * 1024 * 1024)  # allocated before the baseline: it is the sender's
    with server(keys, max_request_bytes=32 * 1024 * 1024) as srv:
        context = zmq.Context()
        senders = []
        before = memory_mb("self", "VmRSS") or 0.0
        for _ in range(12):
            sock = context.socket(zmq.DEALER)
            sock.linger = 0
            sock.connect(srv.address)
            sock.send_multipart([rp.transport.pack_request_id(1), big], copy=False)
            senders.append(sock)
        done = threading.Event()
        threading.Timer(3.0, done.set).start()
        peak = before
        while not done.wait(0.05):
            peak = max(peak, memory_mb("self", "VmRSS") or 0.0)
        for sock in senders:
            sock.close(0)
        context.term()
        with client(srv.address, keys.credential("controller") if keys else None) as controller:
            assert controller.call(VERIFY, expect=rp.VerifyResult).message.correct
    assert peak - before < 50, f"RSS rose {peak - before:.0f} MB"


def test_rlax_keys_writes_one_private_file_per_role_that_serves_and_connects(
    tmp_path: pytest.TempPathFactory,
) -> None:
    from rlax_protocol.auth import keys_main

    directory = tmp_path / "keys"  # type: ignore[operator]
    assert keys_main([str(directory), "--mechanism", "curve"]) == 0
    files = sorted(p.name for p in directory.iterdir())
    assert files == ["controller.json", "observer.json", "server.json", "trainer.json", "worker.json"]
    assert all((directory / name).stat().st_mode & 0o777 == 0o600 for name in files)
    credential = {name[:-5]: Credential.from_json((directory / name).read_text()) for name in files}
    srv = rp.RpcServer(
        "tcp://127.0.0.1:*",
        handler,
        server_id="by-hand",
        permissions=PERMISSIONS,
        credential=credential["server"],
    )
    srv.start()
    try:
        with client(srv.address, credential["controller"]) as controller:
            assert controller.call(VERIFY, expect=rp.VerifyResult).message.correct
        with client(srv.address, credential["observer"]) as observer, pytest.raises(rp.RemoteError):
            observer.call(VERIFY)
    finally:
        srv.stop()
