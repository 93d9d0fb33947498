"""The worker process loop with a real parameter server and the real engine (tiny model)."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import jax
import numpy as np
import pytest
import zmq
from rlax_core.config import load_config
from rlax_core.links import PeerLink

from rlax_data.run_task import build_task
from rlax_inference import worker_service
from rlax_inference.worker_service import WorkerService
from rlax_model import init_params
from rlax_model.run_model import build_model_config
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol.fuzzing import blast, deep_nesting, hostile_requests
from rlax_protocol.messages import (
    PROTOCOL_VERSION,
    ErrorReply,
    GenerateRequest,
    GenerateResult,
    Hello,
    SamplingParams,
    Welcome,
    decode,
    encode,
)
from rlax_protocol.transport import parse_request


def wait_reply(worker: WorkerService, link: PeerLink, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.step()
        replies = link.receive()
        if replies:
            return replies[0][1]
    raise TimeoutError("no reply from the worker")


@pytest.fixture
def setup(tmp_path: pathlib.Path, free_tcp_port: int):
    with running_server(tmp_path / "ps") as ps_address:
        config = load_config(
            None,
            [
                f"paramserver.address={ps_address}",
                f"workers.addresses=[tcp://127.0.0.1:{free_tcp_port}]",
                "workers.count=1",
                "workers.j=2",
                "workers.max_batch_seqs=8",
                "model.max_seq_len=16",
                "model.d_model=32",
                "model.n_heads=2",
                "model.n_kv_heads=1",
                "model.n_layers=1",
                "data.task_args={digits: 1}",
                f"run.output_dir={tmp_path / 'run'}",
            ],
        )
        model_config = build_model_config(config, build_task(config).tokenizer)
        pusher = ParamClient(ps_address, timeout_s=10)
        worker = WorkerService(config, 0)
        ctx = zmq.Context.instance()
        link = PeerLink(config.workers.addresses[0], encode=encode, decode=decode, context=ctx)
        yield config, model_config, pusher, worker, link
        link.close()
        worker.close()
        pusher.close()


def send(worker: WorkerService, link: PeerLink, message: Any) -> None:
    # IMMEDIATE: nothing is queued until the TCP connection is up.
    deadline = time.monotonic() + 10
    while link.send(message) is None:
        assert time.monotonic() < deadline, "could not connect to the worker"
        worker.step()
        time.sleep(0.01)


def push(pusher: ParamClient, model_config: Any, version: int) -> None:
    params = init_params(model_config, jax.random.key(version))
    pusher.push(jax.tree.map(np.asarray, params), version)


def generate(
    worker: WorkerService, link: PeerLink, name: str, prompt: tuple[int, ...] = (1, 5, 13, 6, 14)
) -> Any:
    sampling = SamplingParams(max_tokens=4, temperature=1.0, seed=7, stop_token_ids=(2,))
    send(worker, link, GenerateRequest(request_id=name, prompt_token_ids=prompt, sampling=sampling, n=4))
    return wait_reply(worker, link)


def test_worker_generates_with_one_version_and_reloads_only_j_behind(setup: Any) -> None:
    config, model_config, pusher, worker, link = setup
    send(worker, link, Hello(protocol_version=PROTOCOL_VERSION))
    welcome = wait_reply(worker, link, timeout=10)
    assert isinstance(welcome, Welcome) and welcome.server_id.startswith("worker0-")
    push(pusher, model_config, 0)
    first = generate(worker, link, "a")
    assert isinstance(first, GenerateResult) and first.request_id == "a" and first.weight_version == 0
    assert len(first.samples) == 4
    for sample in first.samples:
        assert len(sample.logprobs) == len(sample.token_ids) <= 4 and all(lp <= 0 for lp in sample.logprobs)
    push(pusher, model_config, 1)  # one version behind: j=2 keeps the old weights
    assert generate(worker, link, "b").weight_version == 0
    push(pusher, model_config, 2)  # two behind: reload
    assert generate(worker, link, "c").weight_version == 2
    assert worker.reloads == 1
    # Same seed, same weights, same prompt: the same samples (batch-independent seeding).
    again = generate(worker, link, "d")
    assert again.weight_version == 2
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in generate(worker, link, "e").samples]


def test_warm_up_covers_the_runs_shapes_and_results_carry_running_totals(setup: Any) -> None:
    config, model_config, pusher, worker, link = setup
    push(pusher, model_config, 0)
    first = generate(worker, link, "a")  # the first weights: engine, then warm-up
    assert first.stats is not None and first.stats.compile_s > 0.0
    compiled = sum(worker.engine.runner.num_compilations.values())
    second = generate(worker, link, "b")
    # The run's shapes (one group's rows, the task's prompt lengths) were compiled at start.
    assert sum(worker.engine.runner.num_compilations.values()) == compiled
    a, b = first.stats, second.stats
    assert b is not None
    assert b.generated_tokens - a.generated_tokens == sum(len(s.token_ids) for s in second.samples)
    assert b.compile_s == a.compile_s and b.engine_s > a.engine_s
    assert b.active_s - a.active_s >= b.engine_s - a.engine_s > 0.0
    push(pusher, model_config, 2)  # j=2 behind: the next request reloads first
    third = generate(worker, link, "c")
    assert third.weight_version == 2 and third.stats is not None
    assert third.stats.reloads == 1 and third.stats.reload_s > b.reload_s


def test_worker_rejects_a_bad_request_and_keeps_serving(setup: Any) -> None:
    config, model_config, pusher, worker, link = setup
    push(pusher, model_config, 0)
    bad = generate(worker, link, "bad", prompt=(1, 999))  # token id outside the vocabulary
    assert isinstance(bad, ErrorReply) and "bad" in bad.message
    good = generate(worker, link, "good")
    assert isinstance(good, GenerateResult)


def test_worker_survives_ten_thousand_hostile_messages_then_answers_a_correct_request(
    setup: Any, loop_thread: Any
) -> None:
    config, model_config, pusher, worker, link = setup
    push(pusher, model_config, 0)
    # Weights loaded and the run's shapes compiled first: the loop is not answering while
    # it compiles, which is start-up, not what this test attacks.
    assert isinstance(generate(worker, link, "warm"), GenerateResult)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, seed=1)
    valid = [
        encode(GenerateRequest(request_id="v", prompt_token_ids=(1, 5, 13), sampling=sampling, n=1)),
        encode(Hello(protocol_version=PROTOCOL_VERSION)),
    ]
    requests = list(hostile_requests(10_000, seed=5, valid=valid))
    assert any(parts[1:] == [deep_nesting(1000)] for parts in requests)
    pump = loop_thread(lambda: worker.step() or time.sleep(0.001))
    replies = 0
    try:
        for start in range(0, len(requests), 2_000):  # in parts, to fail fast once the loop died
            # Hostile requests of new shapes compile mid-blast: on a loaded machine a step can
            # stay silent for seconds, so a dead loop is declared only after 10 silent waits.
            replies += blast(
                worker.address, requests[start : start + 2_000], settle_s=1.0, max_silent_waits=10
            )
            assert pump.error is None, repr(pump.error)
    finally:
        pump.stop()
    assert pump.error is None, repr(pump.error)
    assert replies > 5_000
    good = generate(worker, link, "after")
    assert isinstance(good, GenerateResult) and good.request_id == "after" and len(good.samples) == 4


def test_an_exception_from_one_message_is_answered_and_the_worker_keeps_serving(
    setup: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, model_config, pusher, worker, link = setup
    push(pusher, model_config, 0)

    def parse_or_fail(parts: Any) -> Any:
        if len(parts) > 2 and parts[2].bytes == b"boom":
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")
        return parse_request(parts)

    # Whatever the decoder (or a handler) raises on one message, the loop lives on.
    monkeypatch.setattr(worker_service, "parse_request", parse_or_fail)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(worker.address)
    try:
        dealer.send_multipart([(9).to_bytes(8, "little"), b"boom"])
        deadline = time.monotonic() + 10
        while not dealer.poll(10):
            assert time.monotonic() < deadline, "the failing message was not answered"
            worker.step()
        error = decode(dealer.recv_multipart()[1])
        assert (
            isinstance(error, ErrorReply) and error.code == "internal" and "RecursionError" in error.message
        )
    finally:
        dealer.close(0)
    assert isinstance(generate(worker, link, "after"), GenerateResult)


def test_bfloat16_on_a_cpu_worker_computes_in_float32_and_says_so(
    tmp_path: pathlib.Path, free_tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    # The trainer process applies the same rlax_model.dtype_policy: both sides compute alike.
    with running_server(tmp_path / "ps") as ps_address:
        config = load_config(
            None,
            [
                f"paramserver.address={ps_address}",
                f"workers.addresses=[tcp://127.0.0.1:{free_tcp_port}]",
                "workers.count=1",
                "model.param_dtype=bfloat16",
                f"run.output_dir={tmp_path / 'run'}",
            ],
        )
        with caplog.at_level("WARNING", logger="rlax.model"):
            worker = WorkerService(config, 0)
        try:
            assert worker.model_config.param_dtype == "float32"
            assert worker.model_config.compute_dtype == "float32"
            assert "bfloat16" in caplog.text and "float32" in caplog.text
        finally:
            worker.close()
