"""Environments stepped in the verifier service (`agent.where: service`): the same steps
as in the worker, no session state in the service, and hostile requests refused alone."""

from __future__ import annotations

import threading

import msgspec
import pytest

import rlax_protocol as rp
from rlax_data import Record
from rlax_data.envs import EnvStep, make_environment
from rlax_data.envs.remote import EnvOptions, RemoteEnvironments
from rlax_data.verifier_process import VerifierService, default_routes
from rlax_data.verify import build_verifier

RECORD = Record(id="r1", prompt="123*45=", answer="5535", task="tool_arithmetic")
STATEFUL_MODULE = '''
import threading
from rlax_data.envs import EnvStep

HANG = threading.Event()


class Counting:
    """Each observation depends on every earlier turn: the service must replay them."""

    name = "counting"

    def __init__(self, **options):
        self.seen = []

    def reset(self, record):
        self.seen = [record.id]
        return record.prompt

    def step(self, model_turn):
        self.seen.append(model_turn)
        if model_turn == "boom":
            raise RuntimeError("the environment broke")
        if model_turn == "hang":
            HANG.wait(30)
        return EnvStep("|".join(self.seen), done=model_turn == "bye", tool_calls=1)
'''


class Service:
    def __init__(self, address: str = "tcp://127.0.0.1:*", env_paths: tuple[str, ...] = ()) -> None:
        self.svc = VerifierService(
            build_verifier(default_routes()), address=address, poll_s=0.05, env_paths=env_paths
        )
        self.address = self.svc.bound_address
        self.thread = threading.Thread(target=self.svc.serve, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.svc.stop()
        self.thread.join(timeout=10)
        self.svc.close()
        assert not self.thread.is_alive()


@pytest.fixture
def stateful(tmp_path, monkeypatch):
    (tmp_path / "counting_envs.py").write_text(STATEFUL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "counting_envs:Counting"


def remotes(address: str, fmt: str = "bracket", timeout_s: float = 5.0) -> RemoteEnvironments:
    return RemoteEnvironments(address, options=EnvOptions(format=fmt), timeout_s=timeout_s)


def test_a_remote_calculator_trajectory_equals_the_local_one():
    service = Service()
    envs = remotes(service.address)
    try:
        turns = ["[123*45]", "[12*]", "[no_tool]", "5535"]
        local = make_environment("calculator", format="bracket")
        local.reset(RECORD)
        want = [local.step(t) for t in turns]
        remote = envs.make("calculator")
        assert remote.reset(RECORD) == ""
        got = [remote.step(t) for t in turns]
        assert got == want
        assert got[0] == EnvStep("(5535)", done=False, tool_calls=1, tool_correct=False)
        assert got[1].tool_errors == 1 and got[1].error and got[-1].done
        # The verdict needs the first call's result: the service replayed the earlier turns.
        assert got[-1].tool_correct is True
        assert service.svc.envs.stats["env_replayed_turns"] == 0 + 1 + 2 + 3
        assert service.svc.envs.stats["env_steps"] == 4
    finally:
        envs.close()
        service.stop()


def test_an_environment_without_a_judge_is_not_replayed():
    service = Service()
    envs = remotes(service.address)
    try:
        remote = envs.make("tools")
        remote.reset(RECORD)
        steps = [remote.step(t) for t in ("[123*45]", "5535")]
        assert [s.tool_correct for s in steps] == [None, None] and steps[-1].done
        # Its steps are independent: nothing was replayed.
        assert service.svc.envs.stats["env_replayed_turns"] == 0
    finally:
        envs.close()
        service.stop()


def test_a_stateful_environment_is_replayed_and_survives_a_service_restart(stateful):
    service = Service(env_paths=(stateful,))
    envs = remotes(service.address)
    try:
        remote = envs.make(stateful)
        remote.reset(RECORD)
        assert remote.step("a").observation == "r1|a"
        assert remote.step("b").observation == "r1|a|b"
        # The service keeps no session: a new one on the same address goes on exactly.
        address = service.address
        service.stop()
        service = Service(address=address, env_paths=(stateful,))
        step = remote.step("bye")
        assert step == EnvStep("r1|a|b|bye", done=True, tool_calls=1)
        assert service.svc.envs.stats["env_replayed_turns"] == 2
    finally:
        envs.close()
        service.stop()


def test_module_paths_are_served_only_when_the_service_was_started_with_them(stateful):
    service = Service()  # no paths: a request cannot make the service import a module
    envs = remotes(service.address)
    try:
        remote = envs.make(stateful)
        remote.reset(RECORD)
        with pytest.raises(rp.RemoteError, match="not_found.*counting_envs:Counting"):
            remote.step("a")
        for path in ("os:system", "subprocess:run"):
            hostile = envs.make(path)
            hostile.reset(RECORD)
            with pytest.raises(rp.RemoteError, match="not_found"):
                hostile.step("echo pwned")
    finally:
        envs.close()
        service.stop()


def call(client: rp.RpcClient, **fields) -> rp.Message:
    request = rp.EnvStepRequest(
        **{"request_id": "h", "environment": "calculator", "record": msgspec.json.encode(RECORD).decode(),
           "turns": ("[1+1]",), "options": '{"format": "bracket"}', "timeout_s": 2.0, **fields}
    )  # fmt: skip
    return client.call(request).message


def test_hostile_requests_are_refused_alone_and_the_service_keeps_serving(stateful):
    service = Service(env_paths=(stateful,))
    client = rp.RpcClient(service.address, timeout_s=10.0, retries=0)
    try:
        deep = '{"id": "x", "prompt": "p", "metadata": ' + '{"a": ' * 10_000 + "1" + "}" * 10_000 + "}"
        cases = [
            ({"record": deep}, "malformed"),
            ({"record": "not json"}, "malformed"),
            ({"record": '{"prompt": "no id"}'}, "malformed"),
            # Only the three common options; a sandbox or anything else cannot be passed.
            ({"options": '{"sandbox": {"isolation": "process"}}'}, "malformed"),
            ({"options": '{"max_result_chars": 1e12}'}, "malformed"),
            ({"options": '{"tool_timeout_s": -1}'}, "malformed"),
            ({"environment": "chess"}, "not_found"),
            ({"environment": stateful, "turns": ("boom",)}, "env_failed"),
        ]
        for fields, code in cases:
            with pytest.raises(rp.RemoteError) as error:
                call(client, **fields)
            assert error.value.code == code, fields
        # A huge trajectory is bounded by the message limits, not by the service's memory.
        with pytest.raises(rp.RemoteError):
            call(client, turns=("x" * (40 << 20),))
        assert call(client) == rp.EnvStepResult(
            request_id="h", observation="(2)", done=False, tool_calls=1, tool_correct=False
        )
    finally:
        client.close()
        service.stop()


def test_a_hanging_environment_times_out_and_the_service_answers_the_next_request(stateful):
    service = Service(env_paths=(stateful,))
    client = rp.RpcClient(service.address, timeout_s=10.0, retries=0)
    try:
        # The service answers (the client would time out after 10 s without a reply).
        with pytest.raises(rp.RemoteError, match="timeout"):
            call(client, environment=stateful, turns=("hang",), timeout_s=0.5)
        assert call(client).observation == "(2)"
    finally:
        import counting_envs

        counting_envs.HANG.set()
        client.close()
        service.stop()


def test_twenty_hung_steps_do_not_take_the_service_threads(stateful):
    """Issue 29: the service's 8 fixed threads stayed blocked in hung steps, and every
    later step (a calculator's too) timed out."""
    import importlib

    from rlax_data.envs.remote import EnvStepServer

    hang = importlib.import_module("counting_envs").HANG
    hang.clear()  # an earlier test may have released it (the module is imported once)
    server = EnvStepServer(threads=8, allowed_paths=[stateful])
    options = msgspec.json.encode(EnvOptions(format="bracket")).decode()
    record = msgspec.json.encode(RECORD).decode()

    def ask(environment: str, turn: str, wait_s: float):
        request = rp.EnvStepRequest(request_id=turn, environment=environment, record=record,
                                    turns=(turn,), options=options, timeout_s=wait_s)  # fmt: skip
        return server.answer(request, server.submit(request), wait_s)

    try:
        for _ in range(20):
            reply = ask(stateful, "hang", 0.02)
            assert isinstance(reply, rp.RemoteError) and reply.code == "timeout"
        reply = ask("calculator", "[6*7]", 10.0)
        assert isinstance(reply, rp.EnvStepResult) and reply.observation == "(42)"
        assert server.abandoned == 20 and server.stats["env_errors"] == 20
    finally:
        hang.set()
        server.close()
