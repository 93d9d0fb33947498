"""`RpcServer` answering later: a handler returns a future of its reply, the loop keeps
receiving (and answering others) meanwhile and sends the reply from its own thread once
the future is done; work kept on the serving thread runs in slices between receives."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import zmq

import rlax_protocol as rp
from rlax_protocol import RpcClient


def _verify(rid: str, completion: str) -> rp.VerifyRequest:
    return rp.VerifyRequest(request_id=rid, verifier="v", completion=completion, reference="ok")


def _result(rid: str) -> rp.VerifyResult:
    return rp.VerifyResult(request_id=rid, reward=1.0, correct=True)


def test_a_deferred_reply_does_not_hold_up_the_next_request() -> None:
    later: Future[rp.Message] = Future()
    peers: list[bytes] = []

    def handler(batch: list[tuple[rp.Message, list[zmq.Frame], bytes]]) -> list[object]:
        out: list[object] = []
        for message, _, peer in batch:
            assert isinstance(message, rp.VerifyRequest)
            peers.append(peer)
            out.append(later if message.completion == "later" else _result(message.request_id))
        return out

    server = rp.RpcServer("tcp://127.0.0.1:*", batch_handler=handler, with_peer=True, poll_s=0.02)
    server.start()
    try:
        with (
            RpcClient(server.address, timeout_s=5, retries=0) as a,
            RpcClient(server.address, timeout_s=5) as b,
        ):
            waiting = a.send_request(_verify("slow", "later"))
            assert b.call(_verify("fast", "ok")).message == _result("fast")  # while "slow" waits
            threading.Timer(0.1, later.set_result, [_result("slow")]).start()  # done in another thread
            _, reply = a.recv_reply({waiting}, timeout_s=5, operation="deferred")
            assert reply.message == _result("slow")
        assert len(peers) == 2 and peers[0] != peers[1]  # each client by its own identity
        assert server.stats["deferred"] == 1
    finally:
        server.stop()


def test_a_deferred_failure_or_cancellation_is_answered_as_an_error() -> None:
    futures: dict[str, Future[rp.Message]] = {"raise": Future(), "cancel": Future()}

    def handler(message: rp.Message, frames: list[zmq.Frame]) -> Future[rp.Message]:
        assert isinstance(message, rp.VerifyRequest)
        future = futures[message.completion]
        threading.Timer(0.05, _finish, [message.completion, future]).start()
        return future

    def _finish(kind: str, future: Future[rp.Message]) -> None:
        if kind == "raise":
            future.set_exception(rp.RemoteError("busy", "come back later"))
        else:
            future.cancel()

    with rp.RpcServer("tcp://127.0.0.1:*", handler, poll_s=0.02) as server:
        with RpcClient(server.address, timeout_s=5, retries=0) as client:
            with pytest.raises(rp.RemoteError, match="come back later") as raised:
                client.call(_verify("r", "raise"), retry=False)
            assert raised.value.code == "busy"
            with pytest.raises(rp.RemoteError, match="stopped before answering") as cancelled:
                client.call(_verify("c", "cancel"), retry=False)
            assert cancelled.value.code == "internal"


def test_main_work_runs_in_slices_on_the_serving_thread_between_receives() -> None:
    slices: list[threading.Thread] = []
    queued: list[tuple[str, Future[rp.Message]]] = []

    def work() -> bool:
        """One request finished per slice."""
        slices.append(threading.current_thread())
        if queued:
            rid, future = queued.pop(0)
            future.set_result(_result(rid))
        return bool(queued)

    def handler(message: rp.Message, frames: list[zmq.Frame]) -> Future[rp.Message]:
        assert isinstance(message, rp.VerifyRequest)
        future: Future[rp.Message] = Future()
        queued.append((message.request_id, future))
        return future

    server = rp.RpcServer("tcp://127.0.0.1:*", handler, main_work=work, poll_s=0.02)
    address = server.listen()
    got: list[object] = []

    def client() -> None:
        try:
            with RpcClient(address, timeout_s=5, retries=0) as c:
                pending = {c.send_request(_verify(f"r{i}", "ok")) for i in range(5)}
                while pending:
                    rid, reply = c.recv_reply(pending, timeout_s=5, operation="sliced")
                    pending.discard(rid)
                    got.append(reply.message)
        finally:
            server.shutdown()

    thread = threading.Thread(target=client)
    thread.start()
    server.serve_forever()
    thread.join(10)
    server.stop()
    assert sorted(m.request_id for m in got) == [f"r{i}" for i in range(5)]  # type: ignore[attr-defined]
    assert set(slices) == {threading.current_thread()}
