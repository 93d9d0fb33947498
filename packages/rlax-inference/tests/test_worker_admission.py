"""One client cannot hold up another (issue 29): a request for a version the parameter server
does not have waits a bounded, server-side time aside from the others and is answered
``version_unavailable``; every size and count a request asks for has a server maximum,
named when exceeded; a failed load of a pinned version is tried a bounded number of times
and reported to its requests; admission is round robin across clients, with a bounded
number of requests in flight per client. The in-process worker, the tiny random Llama and
a real parameter server on loopback."""

import dataclasses
import threading
import time

import msgspec
import pytest
from test_worker import (
    ENGINE,
    PARAMS,
    PARAMS_V2,
    RunningWorker,
    greedy_request,
    pinned,
    push,
    request_with,
    roundtrip,
)
from test_worker_run import PullBlockingProxy
from tiny_model import naive_greedy

import rlax_protocol as rp
from rlax_core.config import load_config
from rlax_inference.admission import AdmissionQueue, RequestLimits
from rlax_inference.worker_io import Job
from rlax_inference.worker_process import Worker, WorkerConfig
from rlax_paramserver.testing import running_server


class StartedWorker(RunningWorker):
    """`RunningWorker` with any `WorkerConfig` field overridden (its pull deadline too)."""

    def __init__(self, ps_address, engine=ENGINE, **cfg):
        settings = {"weights_poll_s": 0.05, "rpc_timeout_s": 10.0, **cfg}
        self.worker = Worker(WorkerConfig(paramserver=ps_address, **settings), engine)
        self.address = self.worker.start()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()


@pytest.fixture
def paramserver(tmp_path):
    with running_server(tmp_path / "ps") as address:
        yield address


class Replies:
    """A client's replies as they arrive, each with the time it arrived."""

    def __init__(self, client: rp.RpcClient) -> None:
        self.client = client
        self.sent: dict[int, tuple[str, float]] = {}
        self.got: dict[str, tuple[rp.Message, float]] = {}

    def send(self, request: rp.GenerateRequest) -> None:
        self.sent[self.client.send_request(request)] = (request.request_id, time.monotonic())

    def wait(self, name: str, timeout_s: float = 60.0) -> rp.Message:
        deadline = time.monotonic() + timeout_s
        while name not in self.got:
            pending = {rid for rid, (n, _) in self.sent.items() if n not in self.got}
            rid, reply = self.client.recv_reply(
                pending, timeout_s=max(0.01, deadline - time.monotonic()), operation=name
            )
            self.got[self.sent[rid][0]] = (reply.message, time.monotonic())
        return self.got[name][0]

    def poll(self, timeout_s: float) -> None:
        """Take one reply if one arrives within `timeout_s` (its time is when it arrived)."""
        pending = {rid for rid, (n, _) in self.sent.items() if n not in self.got}
        if not pending:
            return
        try:
            rid, reply = self.client.recv_reply(pending, timeout_s=timeout_s, operation="poll")
        except rp.ProtocolTimeoutError:
            return
        self.got[self.sent[rid][0]] = (reply.message, time.monotonic())

    def drain(self) -> None:
        """Take every reply that has already arrived (none is waited for)."""
        while len(self.got) < len(self.sent):
            before = len(self.got)
            self.poll(0.05)
            if len(self.got) == before:
                return

    def waited(self, name: str) -> float:
        sent = next(t for n, t in self.sent.values() if n == name)
        return self.got[name][1] - sent


def gather(*clients: Replies, timeout_s: float = 120.0) -> None:
    """Every reply of every client, each timed when it arrived (the clients are polled in turn)."""
    deadline = time.monotonic() + timeout_s
    while any(len(c.got) < len(c.sent) for c in clients):
        assert time.monotonic() < deadline, "replies missing"
        for c in clients:
            c.poll(0.002)


def test_a_hostile_client_does_not_hold_up_another_and_gets_its_errors(paramserver):
    """Before: the version 10**9 request blocked admission in arrival order and its reload
    was retried forever; the other client got no answer at all (40 s measured)."""
    push(paramserver, PARAMS, 1)
    wait_s = 4.0
    w = StartedWorker(paramserver, version_wait_s=wait_s)
    prompt = [5, 6, 7]
    try:
        with (
            rp.RpcClient(w.address, timeout_s=30, client_id="good") as good_client,
            rp.RpcClient(w.address, timeout_s=30, client_id="hostile") as hostile_client,
        ):
            good, hostile = Replies(good_client), Replies(hostile_client)
            good.send(greedy_request("warm", prompt))
            assert isinstance(good.wait("warm"), rp.GenerateResult)
            hostile.send(pinned("far", prompt, 10**9))
            hostile.send(pinned("next", prompt, 2))  # not published: waits, bounded
            hostile.send(greedy_request("many", prompt, n=10**9))
            hostile.send(greedy_request("long", prompt, max_tokens=10**9))
            hostile.send(request_with("stops", max_tokens=4, stop_strings=("x" * 10_000,)))
            # The refusals made at admission, in the order the socket delivered the requests:
            # once the last is here, the worker has taken in "next" and holds it.
            for refused in ("far", "many", "long", "stops"):
                hostile.wait(refused)
            good.send(greedy_request("ok", prompt))
            ok = good.wait("ok")
            assert isinstance(ok, rp.GenerateResult) and ok.weight_version == 1
            assert list(ok.samples[0].token_ids) == naive_greedy(PARAMS, prompt, 6)
            # What had reached the hostile client when the good answer came: the refusals
            # made at admission, not the held request (a worker that admitted in arrival
            # order would have answered "next" first, after version_wait_s).
            hostile.drain()
            assert "far" in hostile.got and "next" not in hostile.got, sorted(hostile.got)

            far = hostile.wait("far")
            assert isinstance(far, rp.ErrorReply) and far.code == "version_unavailable", far
            assert "1000000000" in far.message and "max_version_lead=4" in far.message
            assert "newest" in far.message and "(1)" in far.message
            for name, field in (
                ("many", "n=1000000000 exceeds this worker's max_num_seqs=32"),
                (
                    "long",
                    f"sampling.max_tokens=1000000000 exceeds this worker's max_model_len={ENGINE.max_model_len}",
                ),
                ("stops", "stop string's length=10000 exceeds this worker's max_stop_string_chars=256"),
            ):
                reply = hostile.wait(name)
                assert isinstance(reply, rp.ErrorReply) and reply.code == "too_large", reply
                assert reply.message.startswith(f"{name}: ") and field in reply.message, reply.message

            late = hostile.wait("next", timeout_s=wait_s + 30)
            assert isinstance(late, rp.ErrorReply) and late.code == "version_unavailable", late
            assert "weight version 2 is not available" in late.message
            assert "newest is 1" in late.message and f"version_wait_s={wait_s:g}" in late.message
            assert hostile.waited("next") >= wait_s  # held for the whole wait, then answered
            assert w.worker.num_refused == {"too_large": 3, "version_unavailable": 2, "not_found": 0}
            # And the worker serves on.
            (again,) = roundtrip(good_client, [greedy_request("again", prompt)])
            assert isinstance(again, rp.GenerateResult)
    finally:
        w.close()


def test_a_request_for_a_version_published_while_it_waits_is_generated_with_it(paramserver):
    push(paramserver, PARAMS, 1)
    w = StartedWorker(paramserver, follow_latest=False, version_wait_s=30.0)
    prompt = [5, 6, 7, 8]
    try:
        with rp.RpcClient(w.address, timeout_s=30, client_id="c") as client:
            (first,) = roundtrip(client, [pinned("v1", prompt, 1)])
            assert first.weight_version == 1
            replies = Replies(client)
            replies.send(pinned("v2", prompt, 2))
            replies.send(pinned("v1-after", prompt, 1))  # not held up by the request for 2
            after = replies.wait("v1-after")
            assert isinstance(after, rp.GenerateResult) and after.weight_version == 1
            assert "v2" not in replies.got
            push(paramserver, PARAMS_V2, 2)
            result = replies.wait("v2")
            assert isinstance(result, rp.GenerateResult) and result.weight_version == 2, result
            assert list(result.samples[0].token_ids) == naive_greedy(PARAMS_V2, prompt, 6)
    finally:
        w.close()


def test_a_failed_load_is_tried_a_bounded_number_of_times_then_reported(tmp_path):
    """Pulls hang (a parameter server that answers version queries only): the pinned version's
    load is tried `version_load_attempts` times, backing off, then its request is answered
    with the error; requests for the loaded weights are served meanwhile."""
    prompt = [5, 6, 7]
    with running_server(tmp_path / "ps") as address:
        proxy = PullBlockingProxy(address)
        push(address, PARAMS, 1)
        w = StartedWorker(
            proxy.address,
            follow_latest=False,
            rpc_timeout_s=0.5,
            pull_retries=0,
            reload_retry_s=0.2,
            version_load_attempts=2,
            version_wait_s=60.0,
        )
        try:
            with (
                rp.RpcClient(w.address, timeout_s=30, client_id="a") as a_client,
                rp.RpcClient(w.address, timeout_s=30, client_id="b") as b_client,
            ):
                (warm,) = roundtrip(b_client, [greedy_request("warm", prompt)])
                assert warm.weight_version == 1
                push(address, PARAMS_V2, 2)
                proxy.block_pulls.set()
                a = Replies(a_client)
                a.send(pinned("v2", prompt, 2))
                (ok,) = roundtrip(b_client, [pinned("v1", prompt, 1)])
                assert isinstance(ok, rp.GenerateResult) and ok.weight_version == 1
                failed = a.wait("v2", timeout_s=30)
                assert isinstance(failed, rp.ErrorReply) and failed.code == "version_unavailable", failed
                assert "loading weight version 2 failed 2 times (version_load_attempts=2)" in failed.message
                assert "timed out" in failed.message, failed.message
                attempts = proxy.held_pulls
                assert attempts == 2
                time.sleep(1.0)  # no retry once its requests are answered
                assert proxy.held_pulls == attempts and w.worker.version == 1
        finally:
            proxy.release()
            w.close()
            proxy.close()


def test_one_clients_many_requests_do_not_starve_another(paramserver):
    """Two sequences fit the engine: client A's six long requests (its limit) go in two at a
    time; client B's short one, sent after all of them, goes in at the first free slot, so
    at most A's first two finish before it (in arrival order, as before, all six did). A's
    seventh is answered busy. B's seeded samples are those it gets when sent alone."""
    push(paramserver, PARAMS, 1)
    small = dataclasses.replace(ENGINE, max_num_seqs=2)
    w = StartedWorker(paramserver, engine=small, max_inflight_per_client=6)
    seeded = request_with("b", prompt=[9, 10, 11], max_tokens=8, temperature=1.0, seed=11)
    try:
        with (
            rp.RpcClient(w.address, timeout_s=30, client_id="a") as a_client,
            rp.RpcClient(w.address, timeout_s=30, client_id="b") as b_client,
        ):
            (alone,) = roundtrip(b_client, [seeded])
            roundtrip(a_client, [greedy_request("warm", [5, 6, 7], max_tokens=100)] * 2)  # compiled
            a, b = Replies(a_client), Replies(b_client)
            for i in range(7):
                a.send(greedy_request(f"a{i}", [5, 6, 7], max_tokens=100))
            busy = a.wait("a6")
            assert isinstance(busy, rp.ErrorReply) and busy.code == "busy", busy
            assert "max_inflight_per_client=6" in busy.message
            b.send(seeded)
            gather(a, b)
            result = b.got["b"][0]
            assert isinstance(result, rp.GenerateResult)
            assert result.samples == alone.samples  # admission order does not change what it generates
            assert all(isinstance(a.got[f"a{i}"][0], rp.GenerateResult) for i in range(6))
            before_b = [i for i in range(6) if a.got[f"a{i}"][1] < b.got["b"][1]]
            # At most the two that were in the engine when B arrived (none, if B was there first).
            assert set(before_b) <= {0, 1}, before_b
    finally:
        w.close()


def test_every_size_a_request_asks_for_has_a_maximum_named_when_exceeded():
    limits = RequestLimits(
        max_top_logprobs=5, max_stop_token_ids=2, max_stop_strings=1, max_request_id_chars=8
    )
    sizes = {"max_num_seqs": 4, "max_model_len": 16}
    base = request_with("r", max_tokens=4)
    agent = rp.AgentSpec(environment="calc", max_turns=2, max_total_tokens=8)
    assert limits.check(base, **sizes) is None
    assert limits.check(msgspec.structs.replace(base, agent=agent), **sizes) is None
    cases = [
        (msgspec.structs.replace(base, request_id="r" * 9), "request_id length=9", "max_request_id_chars=8"),
        (msgspec.structs.replace(base, n=5), "n=5", "max_num_seqs=4"),
        (
            msgspec.structs.replace(base, prompt_token_ids=(1,) * 16),
            "prompt length=16",
            "max_model_len - 1=15",
        ),
        (request_with("r", max_tokens=17), "sampling.max_tokens=17", "max_model_len=16"),
        (request_with("r", max_tokens=4, top_logprobs=6), "sampling.top_logprobs=6", "max_top_logprobs=5"),
        (
            request_with("r", max_tokens=4, stop_token_ids=(1, 2, 3)),
            "stop_token_ids)=3",
            "max_stop_token_ids=2",
        ),
        (request_with("r", max_tokens=4, stop_strings=("a", "b")), "stop_strings)=2", "max_stop_strings=1"),
        (
            request_with("r", max_tokens=4, stop_strings=("a" * 257,)),
            "stop string's length=257",
            "max_stop_string_chars=256",
        ),
    ]
    for spec, field, limit in (
        (msgspec.structs.replace(agent, max_turns=65), "agent.max_turns=65", "max_agent_turns=64"),
        (
            msgspec.structs.replace(agent, max_total_tokens=17),
            "agent.max_total_tokens=17",
            "max_model_len=16",
        ),
        (
            msgspec.structs.replace(agent, tool_timeout_s=61.0),
            "agent.tool_timeout_s=61.0",
            "max_tool_timeout_s=60.0",
        ),
        (
            msgspec.structs.replace(agent, record="x" * ((1 << 20) + 1)),
            "len(agent.record)=",
            "max_agent_record_chars=",
        ),
    ):
        cases.append((msgspec.structs.replace(base, agent=spec), field, limit))
    for request, field, limit in cases:
        why = limits.check(request, **sizes)
        assert why is not None and field in why and limit in why, (why, field, limit)
    with pytest.raises(ValueError, match=r"RequestLimits.max_stop_strings must be > 0, got 0"):
        RequestLimits(max_stop_strings=0)


def job(key: int, client: bytes, version: int | None = None) -> Job:
    return Job(
        key, msgspec.structs.replace(request_with(f"r{key}", max_tokens=4), weight_version=version), client
    )


def test_admission_is_round_robin_and_sets_unloadable_versions_aside():
    queue = AdmissionQueue()
    for key, client in enumerate([b"A", b"A", b"A", b"B", b"C", b"C"]):
        queue.add(job(key, client), now=0.0)
    order = [q.job.key for q in queue.admissible(1, lambda v: True)]
    assert order == [0, 3, 4, 1, 5, 2]  # A, B, C, A, C, A: each client in its own order
    queue.served(next(q for q in queue if q.job.key == 0))  # A was served last: B, C go first
    assert [q.job.key for q in queue.admissible(1, lambda v: True)] == [3, 4, 1, 5, 2]

    versions = AdmissionQueue()
    versions.add(job(0, b"A", version=10**9), now=0.0)  # cannot be loaded: set aside
    versions.add(job(1, b"B", version=1), now=0.0)
    versions.add(job(2, b"A", version=2), now=0.0)  # loadable: the engine drains for it
    versions.add(job(3, b"B", version=1), now=0.0)
    loadable = lambda v: v <= 2  # noqa: E731
    assert [q.job.key for q in versions.admissible(1, loadable)] == [1]
    assert versions.next_version(1, loadable) is None  # admit key 1 first
    versions.remove({1})
    assert versions.next_version(1, loadable) == 2
    assert [q.job.key for q in versions.admissible(2, loadable)] == [2]


def test_the_run_config_sets_the_waits_and_bounds_from_its_own_settings():
    config = load_config(
        None,
        [
            "controller.request_timeout_s=40",
            "workers.max_inflight_groups=3",
            "workers.max_inflight_requests=8",
            "agent.max_turns=100",
            "workers.count=1",
            "workers.addresses=[tcp://127.0.0.1:5000]",
        ],
    )
    worker = WorkerConfig.from_run(config, 0)
    assert worker.version_wait_limit_s == 20.0  # the controller hears before its own timeout
    assert worker.inflight_per_client == 6  # the controller's training and eval requests fit
    assert worker.limits.max_agent_turns == 100  # the run's own requests are never refused
    assert WorkerConfig(rpc_timeout_s=10).version_wait_limit_s == 5.0
    assert WorkerConfig(max_inflight_requests=64).inflight_per_client == 32
    with pytest.raises(ValueError, match="version_load_attempts must be an int >= 1, got 0"):
        WorkerConfig(version_load_attempts=0)
