"""`VerifierService`'s own limits on what a client asks (issue 29): an environment step's
timeout is clamped to the service's maximum, too many turns are refused naming the limit,
and a client past its share of waiting work is told `busy` while other clients are served."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest

import rlax_protocol as rp
from rlax_data import Record
from rlax_data.tasks import ArithmeticTask
from rlax_data.verifier_process import RemoteVerifier, VerifierService
from rlax_data.verify.answers import ExactMatchVerifier
from rlax_data.verify.registry import RoutingVerifier

HANGING_MODULE = '''
import threading
from rlax_data.envs import EnvStep

RELEASE = threading.Event()


class Hanging:
    """Waits for RELEASE on the turn "hang"; answers any other turn at once."""

    name = "hanging"

    def __init__(self, **options):
        pass

    def reset(self, record):
        return record.prompt

    def step(self, model_turn):
        if model_turn == "hang":
            RELEASE.wait(30)
        return EnvStep(model_turn, done=False)
'''
RECORD = msgspec.json.encode(Record(id="r", prompt="p", answer="1")).decode()


@pytest.fixture
def hanging(tmp_path, monkeypatch) -> Iterator[str]:
    (tmp_path / "hanging_envs.py").write_text(HANGING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hanging_envs", raising=False)  # a fresh RELEASE each test
    yield "hanging_envs:Hanging"
    import hanging_envs

    hanging_envs.RELEASE.set()


@contextmanager
def serving(routes: dict[str, object] | None = None, **kwargs: object) -> Iterator[VerifierService]:
    routes = RoutingVerifier(routes or {"arithmetic": ExactMatchVerifier()})  # type: ignore[arg-type]
    svc = VerifierService(routes, address="tcp://127.0.0.1:*", poll_s=0.05, **kwargs)  # type: ignore[arg-type]
    thread = threading.Thread(target=svc.serve, daemon=True)
    thread.start()
    try:
        yield svc
    finally:
        svc.stop()
        thread.join(timeout=10)
        svc.close()
    assert not thread.is_alive()


def _step(environment: str, turn: str, timeout_s: float = 5.0, turns: int = 1) -> rp.EnvStepRequest:
    return rp.EnvStepRequest(
        request_id=turn, environment=environment, record=RECORD, turns=(turn,) * turns, timeout_s=timeout_s
    )


def test_an_environment_step_asking_more_than_the_maximum_is_cut_at_it(hanging):
    with serving(env_paths=[hanging], max_timeout_s=0.5) as svc, rp.RpcClient(svc.bound_address) as client:
        sent = time.monotonic()
        with pytest.raises(rp.RemoteError) as error:
            client.call(_step(hanging, "hang", timeout_s=1e9), retry=False)
        assert time.monotonic() - sent < 5
        assert error.value.code == "timeout"
        assert "max_timeout_s=0.5" in str(error.value) and "asked 1e+09s" in str(error.value)
        assert client.call(_step(hanging, "hi"), retry=False).message.observation == "hi"  # type: ignore[attr-defined]


def test_more_turns_than_the_service_allows_are_refused_naming_the_limit(hanging):
    with serving(env_paths=[hanging], max_env_turns=3) as svc, rp.RpcClient(svc.bound_address) as client:
        with pytest.raises(rp.RemoteError, match="4 turns.*max_env_turns is 3") as error:
            client.call(_step(hanging, "hi", turns=4), retry=False)
        assert error.value.code == "too_large"
        assert client.call(_step(hanging, "hi", turns=3), retry=False).message.observation == "hi"  # type: ignore[attr-defined]


def test_a_client_past_its_share_is_busy_and_another_client_is_served_meanwhile(hanging):
    with (
        serving(env_paths=[hanging], max_pending_per_client=2) as svc,
        rp.RpcClient(svc.bound_address, timeout_s=10, retries=0) as a,
        rp.RpcClient(svc.bound_address, timeout_s=10, retries=0) as b,
    ):
        hung = [a.send_request(_step(hanging, "hang", timeout_s=20)) for _ in range(2)]
        third = a.send_request(_step(hanging, "hi"))
        _, reply = a.recv_reply({third}, timeout_s=5, operation="third step")
        assert isinstance(reply.message, rp.ErrorReply) and reply.message.code == "busy", reply.message
        assert "max_pending_per_client=2" in reply.message.message and "retry after" in reply.message.message
        # B is answered while A's steps still hang (they wait for RELEASE, set only below):
        # the order of events, not a time bound.
        assert b.call(_step(hanging, "hi"), retry=False).message.observation == "hi"  # type: ignore[attr-defined]
        exact = rp.VerifyRequest(request_id="x", verifier="arithmetic", completion="1", reference="1")
        assert b.call(exact, retry=False).message.correct  # type: ignore[attr-defined]
        with pytest.raises(rp.ProtocolTimeoutError):  # A's steps: still unanswered
            a.recv_reply(set(hung), timeout_s=0.05, operation="a hung step, not yet")
        import hanging_envs

        hanging_envs.RELEASE.set()
        pending = set(hung)
        while pending:
            rid, reply = a.recv_reply(pending, timeout_s=10, operation="hung step")
            pending.discard(rid)
            assert isinstance(reply.message, rp.EnvStepResult)
        assert svc.stats["busy"] == 1


class _SlowExactMatch(ExactMatchVerifier):
    """Takes 0.3 s per call: a chunk is still being scored when the next one arrives."""

    def verify(self, items):  # type: ignore[no-untyped-def]
        time.sleep(0.3)
        return super().verify(items)


def test_remote_verifier_sends_a_busy_chunk_again():
    items = [(r.answer, r) for r in ArithmeticTask().generate(6, seed=1)]
    with serving(max_pending_per_client=1, routes={"arithmetic": _SlowExactMatch()}) as svc:
        remote = RemoteVerifier(svc.bound_address, timeout_s=30, chunk_items=2)
        try:
            assert all(r.correct for r in remote.verify(items))
        finally:
            remote.close()
        assert svc.stats["busy"] >= 1  # three chunks pipelined, one allowed at a time
