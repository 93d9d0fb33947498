"""The controller process logic with real sockets: stand-in workers and a trainer client."""

from __future__ import annotations

import pathlib
import threading
import time
from typing import Any

import pytest
import zmq

from rlax_controller import trainer_endpoint
from rlax_controller.controller import Controller
from rlax_controller.metrics import latest_per_step, read_metrics
from rlax_controller.rollout_scheduler import PromptItem
from rlax_core.config import ConfigError, load_config
from rlax_core.testing import wait_until
from rlax_protocol.control_messages import (
    BatchRequest,
    NoBatchYet,
    RunComplete,
    RunStatus,
    StatusQuery,
    TrainBatch,
    decode_control,
    encode_control,
)
from rlax_protocol.errors import MalformedMessageError, ProtocolTimeoutError, RemoteError
from rlax_protocol.fuzzing import blast, deep_nesting, hostile_requests
from rlax_protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    Hello,
    Sample,
    Welcome,
)
from rlax_protocol.request_links import ControlClient, PeerLink
from rlax_protocol.transport import pack_request_id, parse_request, reply_parts, welcome_for


def make_config(tmp_path: pathlib.Path, port: int, **extra: Any) -> Any:
    overrides = [
        f"run.output_dir={tmp_path / 'run'}",
        "run.steps=6",
        "data.group_size=4",
        "data.prompts_per_step=3",
        "trainer.k=1",
        "workers.max_inflight_groups=2",
        "eval.every=3",
        "eval.n_samples=4",
        "eval.pass_k=[1,4]",
        f"controller.address=tcp://127.0.0.1:{port}",
        "controller.heartbeat_interval_s=0.1",
        "controller.heartbeat_timeout_s=1.0",
    ] + [f"{k}={v}" for k, v in extra.items()]
    return load_config(None, overrides)


# The controller thread serving each address, for `train` to tell a busy controller from a
# stopped one.
RUNNING: dict[str, ControllerThread] = {}


class ControllerThread:
    def __init__(self, config: Any, toy: Any, workers: list[Any], scorer: Any = None) -> None:
        evals = [PromptItem(f"e{i}", (9, i + 1), record=i) for i in range(3)]
        self.controller = Controller(
            config,
            source=toy.Source(),
            scorer=scorer or toy.Scorer(),
            eval_items=evals,
            worker_addresses=[w.address for w in workers],
        )
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        RUNNING[config.controller.address] = self
        self.thread.start()

    def _run(self) -> None:
        try:
            # Generous: on two loaded cores (the suite runs two files at once) a run takes minutes.
            self.code = self.controller.run(stop_after_complete_s=0.1, max_seconds=300)
        except BaseException as error:  # surfaced by the test
            self.error = error
        finally:
            self.controller.close()

    def join(self) -> None:
        # Bounds a hang only: the run itself stops by max_seconds=300.
        self.thread.join(timeout=600)
        if self.error:
            raise self.error
        assert not self.thread.is_alive(), "the controller did not stop"


def train(
    address: str,
    workers: list[Any],
    start_step: int = 0,
    stop_at: int | None = None,
    batches: list[TrainBatch] | None = None,
    metrics: dict[str, float] | None = None,
) -> dict[int, list[str]]:
    """A trainer stand-in: asks for batches, 'trains', advances the workers' weights.
    `batches`: where to keep every batch received."""
    controller = RUNNING[address]
    client = ControlClient(address, encode=encode_control, decode=decode_control, timeout_s=30.0)
    step = start_step
    trained: dict[int, list[str]] = {}
    try:
        while stop_at is None or step < stop_at:
            try:
                reply = client.call(BatchRequest(trainer_step=step, metrics=metrics or {"loss": 0.5}))
            except ProtocolTimeoutError:
                # A busy controller (it draws the summary plot at the end; two loaded cores)
                # is asked again for as long as it runs. One that stopped with exit code 0
                # completed the run: its RunComplete came after this call had given up (the
                # link was reset, so the reply was dropped), and it waits only
                # stop_after_complete_s for a second ask. The caller's checks of the trained
                # steps still catch a run that ended early.
                thread = controller.thread
                thread.join(timeout=5)
                if not thread.is_alive() and controller.error is None and controller.code == 0:
                    break
                assert thread.is_alive(), f"the controller stopped at step {step}: {controller.error!r}"
                continue
            if isinstance(reply, RunComplete):
                assert reply.final_step == step
                break
            if isinstance(reply, NoBatchYet):
                threading.Event().wait(reply.retry_after_s)
                continue
            assert isinstance(reply, TrainBatch) and reply.step == step
            assert all(step - r.policy_version <= 1 for r in reply.rollouts)
            trained[step] = list(reply.rollout_ids)
            if batches is not None:
                batches.append(reply)
            step += 1
            for w in workers:
                w.version = step
    finally:
        client.close()
    return trained


def test_full_run_with_eval_snapshots_and_metrics(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    workers = fake_workers(2)
    config = make_config(tmp_path, toy.port())
    ct = ControllerThread(config, toy, workers)
    trained = train(config.controller.address, workers)
    ct.join()
    assert ct.code == 0
    assert sorted(trained) == list(range(6))
    ids = [i for s in trained.values() for i in s]
    assert len(ids) == len(set(ids)) == 6 * 12
    records = read_metrics(config.output_dir / "metrics.jsonl")
    train_records = latest_per_step(r for r in records if r["kind"] == "train")
    assert [r["step"] for r in train_records] == [1, 2, 3, 4, 5, 6]
    for r in train_records:
        assert r["rollout_ids"] == trained[r["step"] - 1] and r["staleness_max"] <= 1 and r["loss"] == 0.5
    consumed = [p for r in train_records for p in r["consumed_prompt_ids"]]
    assert consumed == [f"p{i}" for i in range(18)]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert all(0.0 <= e["pass@1"] <= e["pass@4"] <= 1.0 for e in evals)
    assert (config.output_dir / "summary.png").exists()
    assert ct.controller.store.steps()[-1] == 6


def test_dead_worker_prompts_go_to_another(tmp_path: pathlib.Path, toy: Any, fake_workers: Any) -> None:
    workers = fake_workers(2)
    config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0})
    ct = ControllerThread(config, toy, workers)
    trained = train(config.controller.address, workers, stop_at=2)
    workers[0].paused.set()  # silent from now on
    trained.update(train(config.controller.address, workers, start_step=2))
    ct.join()
    assert sorted(trained) == list(range(6))
    records = read_metrics(config.output_dir / "metrics.jsonl")
    dead = [r for r in records if r["kind"] == "worker" and r.get("event") == "dead"]
    assert dead and dead[0]["worker"] == "worker0" and "silent" in dead[0]["why"]
    # What it held when it went silent was generated by the other (the run needed it).
    assert ct.controller.scheduler.counters["groups_reassigned"] >= 1


class RouteMissingScorer:
    """A verifier service that serves no route for the run's task."""

    def score(self, item: PromptItem, completions: Any) -> list[tuple[float, bool]]:
        raise RemoteError("not_found", "batch item 0: task='tool_arithmetic': not one of ['math']")


def test_a_task_the_verifier_service_cannot_score_stops_the_run_with_a_config_error(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    # Retrying cannot help: the run used to requeue the group forever.
    workers = fake_workers(1)
    config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0})
    ct = ControllerThread(config, toy, workers, scorer=RouteMissingScorer())
    # The trainer's first request starts the dispatch; no batch can ever be scored. (30 s:
    # under the full suite's load the controller once took more than 5 s to answer.) The
    # request is held until a batch is ready, so the run may stop on the unscorable group
    # while it holds it (seen beside a second suite): stopping answers it.
    client = ControlClient(
        config.controller.address, encode=encode_control, decode=decode_control, timeout_s=30.0
    )
    try:
        reply = client.call(BatchRequest(trainer_step=0, metrics={}))
    except ProtocolTimeoutError:
        # Say why: once (beside a second full suite and a third test run) no answer came,
        # and the controller's own error was never seen because the test stopped here.
        ct.thread.join(timeout=60)
        raise AssertionError(
            f"the controller did not answer; its thread alive={ct.thread.is_alive()}, error={ct.error!r}"
        ) from None
    finally:
        client.close()
    assert isinstance(reply, NoBatchYet), reply
    with pytest.raises(ConfigError, match="verifier service cannot score.*tool_arithmetic"):
        ct.join()


def test_hung_worker_requests_time_out_and_go_elsewhere(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    workers = fake_workers(2)
    workers[0].swallow = True
    config = make_config(
        tmp_path,
        toy.port(),
        **{
            "eval.num_prompts": 0,
            "controller.request_timeout_s": 0.5,
            "controller.first_result_timeout_s": 0.5,  # it never answers: no first compilation to wait for
            "run.steps": 3,
        },
    )
    ct = ControllerThread(config, toy, workers)
    trained = train(config.controller.address, workers)
    ct.join()
    assert sorted(trained) == [0, 1, 2]
    assert ct.controller.scheduler.counters["requests_timed_out"] >= 1
    assert workers[0].served == 0 and workers[1].served >= 9


def test_controller_restart_resumes_same_prompt_sequence(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    workers = fake_workers(2)
    config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0})
    first = ControllerThread(config, toy, workers)
    trained = train(config.controller.address, workers, stop_at=3)
    # Kill the controller between boundaries (it has already sent batch 3? no: the trainer stopped asking).
    first.controller.complete_replied = True  # makes run() return promptly
    first.join()
    second = ControllerThread(config, toy, workers)
    # The first controller never heard how step 3 went; the trainer's next request says it.
    trained.update(train(config.controller.address, workers, start_step=3, metrics={"loss": 0.25}))
    second.join()
    assert sorted(trained) == list(range(6))
    records = latest_per_step(read_metrics(config.output_dir / "metrics.jsonl", kind="train"))
    consumed = [p for r in records for p in r["consumed_prompt_ids"]]
    assert consumed == [f"p{i}" for i in range(18)]
    # Every step's record is complete, the trainer's fields included (issue 16).
    assert [(r["step"], r["loss"], r.get("recovered", False)) for r in records] == [
        (1, 0.5, False), (2, 0.5, False), (3, 0.25, True), (4, 0.25, False), (5, 0.25, False),
        (6, 0.25, False),
    ]  # fmt: skip
    restored = [
        r for r in read_metrics(config.output_dir / "metrics.jsonl", kind="event") if r["event"] == "restored"
    ]
    assert restored and restored[0]["step"] == 3


def test_trainer_rewind_to_older_checkpoint(tmp_path: pathlib.Path, toy: Any, fake_workers: Any) -> None:
    workers = fake_workers(1)
    config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0})
    ct = ControllerThread(config, toy, workers)
    trained = train(config.controller.address, workers, stop_at=4)
    # The trainer's newest checkpoint (4) was corrupt: it restarts from 3 and must get the same prompts.
    again = train(config.controller.address, workers, start_step=3)
    ct.join()
    records = latest_per_step(read_metrics(config.output_dir / "metrics.jsonl", kind="train"))
    consumed = [p for r in records for p in r["consumed_prompt_ids"]]
    assert consumed == [f"p{i}" for i in range(18)]
    assert sorted(again) == [3, 4, 5] and sorted(trained) == [0, 1, 2, 3]


def serve_trainer_side(controller: Controller) -> None:
    """One turn of the controller's trainer-side socket (a test thread drives it alone)."""
    controller.trainer.serve()
    controller.trainer.answer_held(time.monotonic())  # a held BatchRequest is answered within its hold
    controller.trainer.socket.poll(5)


def test_controller_survives_ten_thousand_hostile_messages_then_answers_the_trainer(
    tmp_path: pathlib.Path, toy: Any, loop_thread: Any
) -> None:
    config = make_config(tmp_path, toy.port())
    controller = Controller(config, source=toy.Source(), scorer=toy.Scorer(), worker_addresses=[])
    valid = [
        encode_control(StatusQuery()),
        encode_control(BatchRequest(trainer_step=0, metrics={"loss": 0.5})),
        encode_control(Hello(protocol_version=PROTOCOL_VERSION)),
    ]
    requests = list(hostile_requests(10_000, seed=7, valid=valid))
    assert any(parts[1:] == [deep_nesting(1000)] for parts in requests)
    pump = loop_thread(lambda: serve_trainer_side(controller))
    try:
        replies = 0
        for start in range(0, len(requests), 2_000):  # in parts, to fail fast once the loop died
            replies += blast(config.controller.address, requests[start : start + 2_000], settle_s=1.0)
            assert pump.error is None, repr(pump.error)
        assert replies > 9_000  # every request is answered, the unreadable ones with an error
        client = ControlClient(
            config.controller.address, encode=encode_control, decode=decode_control, timeout_s=10.0
        )
        try:
            status = client.call(StatusQuery())
            assert isinstance(status, RunStatus) and status.total_steps == 6 and not status.finished
            assert isinstance(client.call(BatchRequest(trainer_step=0)), NoBatchYet)  # no workers yet
        finally:
            client.close()
    finally:
        pump.stop()
        controller.close()
    assert pump.error is None, repr(pump.error)


HOSTILE_TOKEN = 99  # only hostile replies carry it: no trained rollout may


class HostileWorker:
    """A worker whose first replies are hostile or malformed (one of each of `TRICKS`, in
    order); afterwards it answers like `FakeWorker`. Hostile results carry `HOSTILE_TOKEN`."""

    # Unreadable replies last: the controller then drops the link (and whatever this
    # worker still answers on it), which would swallow the tricks after them.
    TRICKS = (
        "no_logprobs",
        "wrong_version",
        "negative_version",
        "negative_token",
        "not_a_result",
        "answers_another_request",
        "deep_nesting",
        "huge_length",
        "one_part",
    )

    def __init__(self, address: str) -> None:
        self.address = address
        self.version = 0
        self.tricks = list(self.TRICKS)
        self.played: list[str] = []
        self._held: tuple[bytes, int, GenerateRequest] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _good(self, msg: GenerateRequest) -> GenerateResult:
        seed = msg.sampling.seed or 0
        samples = tuple(
            Sample(token_ids=((seed + i) % 7 + 3, 4), logprobs=(-0.5, -0.25), finish_reason="stop")
            for i in range(msg.n)
        )
        version = self.version if msg.weight_version is None else msg.weight_version
        return GenerateResult(request_id=msg.request_id, samples=samples, weight_version=version)

    def _hostile(self, trick: str, msg: GenerateRequest) -> list[bytes] | GenerateResult | Ack:
        def result(token_ids: tuple[int, ...], logprobs: tuple[float, ...], version: int) -> GenerateResult:
            sample = Sample(token_ids=token_ids, logprobs=logprobs, finish_reason="stop")
            return GenerateResult(
                request_id=msg.request_id, samples=(sample,) * msg.n, weight_version=version
            )

        if trick == "deep_nesting":
            return [deep_nesting(1000)]
        if trick == "huge_length":
            return [b"\xdd\xff\xff\xff\xff"]
        if trick == "one_part":
            return []
        if trick == "no_logprobs":
            return result((HOSTILE_TOKEN, HOSTILE_TOKEN), (), self.version)
        if trick == "wrong_version":  # a result from other weights than the pinned ones
            return result((HOSTILE_TOKEN, 4), (-0.5, -0.5), (msg.weight_version or 0) + 1)
        if trick == "negative_version":
            return result((HOSTILE_TOKEN, 4), (-0.5, -0.5), -5)
        if trick == "negative_token":
            return result((-1, HOSTILE_TOKEN), (-0.5, -0.5), self.version)
        return Ack()

    def _serve(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(self.address)
        try:
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                request = parse_request(sock.recv_multipart(copy=False))
                msg, identity, rid = request.message, request.identity, request.request_id
                if isinstance(msg, Hello):
                    sock.send_multipart(reply_parts(identity, rid, welcome_for(msg, server_id="hostile")))
                    continue
                if not isinstance(msg, GenerateRequest):
                    continue
                if self._held is not None:
                    # Answer this request with a result for the held one, then the held one itself.
                    held_identity, held_rid, held = self._held
                    self._held = None
                    sample = Sample(token_ids=(HOSTILE_TOKEN, 4), logprobs=(-0.5, -0.5), finish_reason="stop")
                    swapped = GenerateResult(
                        request_id=held.request_id, samples=(sample,) * held.n, weight_version=self.version
                    )
                    sock.send_multipart(reply_parts(identity, rid, swapped))
                    sock.send_multipart(reply_parts(held_identity, held_rid, self._good(held)))
                    continue
                trick = self.tricks.pop(0) if self.tricks else None
                if trick is None:
                    sock.send_multipart(reply_parts(identity, rid, self._good(msg)))
                    continue
                self.played.append(trick)
                if trick == "answers_another_request":
                    self._held = (identity, rid, msg)
                    continue
                reply = self._hostile(trick, msg)
                if isinstance(reply, list):
                    sock.send_multipart([identity, pack_request_id(rid), *reply])
                else:
                    sock.send_multipart(reply_parts(identity, rid, reply))
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_hostile_worker_replies_are_dropped_and_the_run_completes(tmp_path: pathlib.Path, toy: Any) -> None:
    worker = HostileWorker(f"tcp://127.0.0.1:{toy.port()}")
    try:
        config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0, "run.steps": 3})
        ct = ControllerThread(config, toy, [worker])
        batches: list[TrainBatch] = []
        trained = train(config.controller.address, [worker], batches=batches)
        ct.join()
    finally:
        worker.stop()
    assert ct.code == 0 and sorted(trained) == [0, 1, 2]
    assert worker.played == list(HostileWorker.TRICKS)
    for batch in batches:
        for rollout in batch.rollouts:
            assert HOSTILE_TOKEN not in rollout.completion_token_ids and rollout.policy_version >= 0
            assert len(rollout.worker_logprobs) == len(rollout.completion_token_ids)
    counters = ct.controller.scheduler.counters
    assert counters["bad_worker_replies"] >= 4 and counters["results_ignored"] >= 1
    assert counters["wrong_version_results"] == 1
    dead = [r for r in read_metrics(config.output_dir / "metrics.jsonl") if r.get("event") == "dead"]
    assert any("protocol error" in r["why"] for r in dead)  # an unreadable reply drops the link


def test_an_exception_from_decoding_one_request_is_answered_and_the_controller_keeps_serving(
    tmp_path: pathlib.Path, toy: Any, monkeypatch: pytest.MonkeyPatch, loop_thread: Any
) -> None:
    config = make_config(tmp_path, toy.port())
    controller = Controller(config, source=toy.Source(), scorer=toy.Scorer(), worker_addresses=[])

    def decode_or_fail(data: Any) -> Any:
        if bytes(data) == b"boom":
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")
        return decode_control(data)

    # Whatever the decoder raises on one message, the loop answers it and lives on.
    monkeypatch.setattr(trainer_endpoint, "decode_control", decode_or_fail)
    pump = loop_thread(lambda: serve_trainer_side(controller))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(config.controller.address)
    try:
        dealer.send_multipart([pack_request_id(5), b"boom"])
        assert dealer.poll(10_000), "the failing message was not answered"
        error = decode_control(dealer.recv_multipart()[1])
        assert (
            isinstance(error, ErrorReply) and error.code == "malformed" and "RecursionError" in error.message
        )
        dealer.send_multipart([pack_request_id(6), encode_control(StatusQuery())])
        assert dealer.poll(10_000), "no answer after the failing message"
        refused = decode_control(dealer.recv_multipart()[1])  # the controller requires Hello first
        assert isinstance(refused, ErrorReply) and refused.code == "handshake_required", refused
        hello = Hello(protocol_version=PROTOCOL_VERSION, client_id="t")
        dealer.send_multipart([pack_request_id(7), encode_control(hello)])
        assert dealer.poll(10_000) and isinstance(decode_control(dealer.recv_multipart()[1]), Welcome)
        dealer.send_multipart([pack_request_id(8), encode_control(StatusQuery())])
        assert dealer.poll(10_000), "no answer after the handshake"
        assert isinstance(decode_control(dealer.recv_multipart()[1]), RunStatus)
    finally:
        dealer.close(0)
        pump.stop()
        controller.close()
    assert pump.error is None, repr(pump.error)


def test_a_reply_the_decoder_chokes_on_is_a_malformed_message_error(toy: Any) -> None:
    def choke(data: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded while deserializing an object")

    address = f"tcp://127.0.0.1:{toy.port()}"
    context = zmq.Context.instance()
    server = context.socket(zmq.ROUTER)
    server.linger = 0
    server.bind(address)
    link = PeerLink(address, encode=encode_control, decode=choke, context=context)
    try:
        wait_until(lambda: link.hello() is not None, what="the link's handshake")
        assert server.poll(10_000)
        identity, request_id, _ = server.recv_multipart()
        server.send_multipart([identity, request_id, deep_nesting(1000)])
        assert link.socket is not None and link.socket.poll(10_000)
        # The caller's loop (the controller's, the trainer's) gets the error it handles.
        with pytest.raises(MalformedMessageError, match=f"peer {address}.*RecursionError"):
            link.receive()
    finally:
        link.close()
        server.close(0)


def test_trainer_metrics_never_replace_the_controllers_fields(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    workers = fake_workers(1)
    config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0, "run.steps": 2})
    ct = ControllerThread(config, toy, workers)
    hostile = {"kind": 1.0, "step": 999.0, "version": -3.0, "loss": float("nan"), "kl": 0.25}
    train(config.controller.address, workers, metrics=hostile)
    ct.join()
    records = [r for r in read_metrics(config.output_dir / "metrics.jsonl") if r.get("kl") == 0.25]
    assert [(r["kind"], r["step"], r["version"]) for r in records] == [("train", 1, 1), ("train", 2, 2)]
    assert not any("loss" in r for r in records)  # not a finite number


def test_a_batch_request_is_held_until_its_batch_is_ready_then_answered_within_the_hold(
    tmp_path: pathlib.Path, toy: Any, loop_thread: Any
) -> None:
    """After the first request (which restores and starts the dispatch), a BatchRequest whose
    batch is not ready is held, not answered `NoBatchYet` at once: the trainer gets its batch
    the moment it is scored. With no worker the batch never comes; the held request is
    answered after the hold with `retry_after_s=0`, and a newer request supersedes it."""
    config = make_config(tmp_path, toy.port())
    controller = Controller(config, source=toy.Source(), scorer=toy.Scorer(), worker_addresses=[])
    pump = loop_thread(lambda: serve_trainer_side(controller))
    client = ControlClient(
        config.controller.address, encode=encode_control, decode=decode_control, timeout_s=30.0
    )
    try:
        first = client.call(BatchRequest(trainer_step=0))
        assert isinstance(first, NoBatchYet) and first.retry_after_s > 0  # the restoring request
        link = client.link
        assert link is not None and link.socket is not None
        started = time.monotonic()
        held = client.call(BatchRequest(trainer_step=0))
        waited = time.monotonic() - started
        assert isinstance(held, NoBatchYet) and held.retry_after_s == 0.0
        assert waited >= trainer_endpoint.BATCH_HOLD_S * 0.9  # monotonic: never answered early
    finally:
        client.close()
        pump.stop()
        controller.close()
    assert pump.error is None, repr(pump.error)


def test_a_worker_that_cannot_take_its_first_group_loses_every_group_of_that_dispatch(
    tmp_path: pathlib.Path, toy: Any
) -> None:
    """Issue 29: `assign()` gave one worker several groups; the first send failed, so the
    worker was declared dead, which released every group dispatched to it, the rest of that
    same assignment included: the next one then had no request id and the controller died
    of an AssertionError (the supervisor restarted it; the chaos test saw nothing)."""
    config = make_config(tmp_path, toy.port(), **{"eval.num_prompts": 0})
    nobody = f"tcp://127.0.0.1:{toy.port()}"  # nothing listens: every send is refused
    controller = Controller(config, source=toy.Source(), scorer=toy.Scorer(), worker_addresses=[nobody])
    try:
        assert isinstance(controller.trainer.answer(BatchRequest(trainer_step=0, metrics={})), NoBatchYet)
        worker = controller.pool.workers["worker0"]
        worker.alive = True  # it answered a Hello once, then went away
        controller.dispatch.dispatch(time.monotonic())
        assert not worker.alive and not worker.requests
        groups = list(controller.scheduler.groups.values())
        assert groups and all(g.status.value == "pending" and g.request_id is None for g in groups)
        # Once it is back, the same groups are dispatched to it.
        worker.alive = True
        sent: list[str] = []
        worker.link.send = lambda message, frames=(): sent.append(message.request_id) or len(sent)  # type: ignore[method-assign]
        controller.dispatch.dispatch(time.monotonic())
        assert len(sent) == config.workers.max_inflight_groups == len(worker.requests)
    finally:
        controller.close()


def test_a_worker_that_moved_is_followed_through_the_address_book(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    """Issue 29: a worker restarted on another node listens at a new address; the launcher
    writes it in the run's address book and the controller reconnects there (its groups go
    back to the queue at once) instead of being restarted to read a new config. The only
    worker is lost and the heartbeat timeout is long: only the book can let the run finish."""
    from rlax_core.addresses import write_address_book

    old, moved = fake_workers(2)
    book = tmp_path / "addresses.json"
    config = make_config(
        tmp_path,
        toy.port(),
        **{"eval.num_prompts": 0, "controller.heartbeat_timeout_s": 600, "addresses.book": str(book)},
    )
    write_address_book(book, {"worker0": old.address})
    ct = ControllerThread(config, toy, [old])
    trained = train(config.controller.address, [old, moved], stop_at=2)
    old.paused.set()  # its node is gone
    write_address_book(book, {"worker0": moved.address})
    rest: dict[int, list[str]] = {}
    trainer = threading.Thread(
        target=lambda: rest.update(train(config.controller.address, [old, moved], start_step=2)), daemon=True
    )
    trainer.start()
    trainer.join(timeout=60)
    assert not trainer.is_alive(), "the run did not finish: the moved worker was not found"
    ct.join()
    trained.update(rest)
    assert ct.code == 0 and sorted(trained) == list(range(6))
    assert ct.controller.pool.workers["worker0"].link.address == moved.address and moved.served > 0
    records = read_metrics(config.output_dir / "metrics.jsonl")
    dead = [r for r in records if r["kind"] == "worker" and r.get("event") == "dead"]
    assert [r["why"] for r in dead] == [f"moved to {moved.address}"]
