"""The worker a run config describes (`Worker.from_run`), with a real parameter server, the
real engine (tiny model) and the run's tokenizer: the j rule, warm-up and running totals,
stop strings, hostile messages, and what the I/O thread does while the engine thread is held
up by a parameter server that does not answer pulls."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import select
import socket
import threading
from typing import Any

import jax
import numpy as np
import pytest
import zmq

import rlax_protocol as rp
from rlax_core.config import load_config
from rlax_core.testing import wait_until
from rlax_data.task_from_config import build_task
from rlax_inference.worker_process import Worker
from rlax_model import init_params
from rlax_model.model_from_config import build_model_config
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server
from rlax_protocol.fuzzing import blast, deep_nesting, hostile_requests

PROMPT = (1, 5, 13, 6, 14)


class PullBlockingProxy:
    """A TCP relay in front of the parameter server that, while `block_pulls` is set, holds
    back every client-to-server packet that starts a pull (`PullBegin`) until released: a
    parameter server that answers version queries but not pulls."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        self.block_pulls = threading.Event()
        self.held_pulls = 0
        self._held: list[tuple[socket.socket, bytes]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, to_server: bool) -> None:
        try:
            while not self._closed.is_set():
                if not select.select([source], [], [], 0.1)[0]:
                    continue
                data = source.recv(1 << 20)
                if not data:
                    return
                with self._lock:
                    if to_server and self.block_pulls.is_set() and b"PullBegin" in data:
                        self._held.append((target, data))
                        self.held_pulls += 1
                        continue
                    if to_server and any(t is target for t, _ in self._held):
                        self._held.append((target, data))  # keep the stream in order behind it
                        continue
                target.sendall(data)
        except OSError:
            return

    def release(self) -> None:
        with self._lock:
            self.block_pulls.clear()
            held, self._held = self._held, []
            for target, data in held:
                try:
                    target.sendall(data)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        for s in self._sockets:
            s.close()


def run_config(tmp_path: pathlib.Path, ps_address: str, port: int, *extra: str) -> Any:
    return load_config(
        None,
        [
            f"paramserver.address={ps_address}",
            f"workers.addresses=[tcp://127.0.0.1:{port}]",
            "workers.count=1",
            "workers.j=2",
            "workers.max_num_seqs=8",
            "model.max_seq_len=16",
            "model.hidden_size=32",
            "model.num_heads=2",
            "model.num_kv_heads=1",
            "model.num_layers=1",
            "data.task_args={digits: 1}",
            f"run.output_dir={tmp_path / 'run'}",
            # These tests send requests that name no version: the worker follows the newest
            # weights (pinned requests: test_worker.py).
            "controller.versions=freshest",
            *extra,
        ],
    )


class Running:
    """A started worker whose engine loop runs in a thread, and a client connected to it."""

    def __init__(self, config: Any, **overrides: Any) -> None:
        self.config = config
        self.model_config = build_model_config(config, build_task(config).tokenizer)
        self.pusher = ParamClient(config.paramserver.address, timeout_s=10)
        self.worker = Worker.from_run(config, 0, **overrides)
        self.address = self.worker.start()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()
        self.client = rp.RpcClient(self.address, timeout_s=120, client_id="test")

    def push(self, version: int, *, address: str | None = None) -> None:
        params = init_params(self.model_config, jax.random.key(version))
        self.pusher.push(jax.tree.map(np.asarray, params), version)

    def send(self, name: str, prompt: tuple[int, ...] = PROMPT, **sampling: Any) -> int:
        settings = {"max_tokens": 4, "temperature": 1.0, "seed": 7, "stop_token_ids": (2,), **sampling}
        request = rp.GenerateRequest(
            request_id=name, prompt_token_ids=prompt, sampling=rp.SamplingParams(**settings), n=4
        )
        return self.client.send_request(request)

    def reply(self, rid: int, timeout_s: float = 120.0) -> Any:
        _, reply = self.client.recv_reply({rid}, timeout_s=timeout_s, operation="GenerateRequest")
        return reply.message

    def generate(self, name: str, prompt: tuple[int, ...] = PROMPT, **sampling: Any) -> Any:
        return self.reply(self.send(name, prompt, **sampling))

    def close(self) -> None:
        self.client.close()
        self.worker.stop()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        self.pusher.close()
        assert not self.worker.errors, self.worker.errors


@pytest.fixture
def running(tmp_path: pathlib.Path, free_tcp_port: int):
    with running_server(tmp_path / "ps") as ps_address:
        r = Running(run_config(tmp_path, ps_address, free_tcp_port))
        yield r
        r.close()


@pytest.fixture
def behind_proxy(tmp_path: pathlib.Path, free_tcp_port: int):
    """A worker (j=1) whose parameter server sits behind a `PullBlockingProxy`; pushes go direct."""
    with running_server(tmp_path / "ps") as ps_address:
        proxy = PullBlockingProxy(ps_address)
        config = run_config(tmp_path, proxy.address, free_tcp_port, "workers.j=1")
        r = Running(config, rpc_timeout_s=60.0)
        r.pusher.close()
        r.pusher = ParamClient(ps_address, timeout_s=10)
        try:
            yield r, proxy
        finally:
            proxy.release()
            r.close()
            proxy.close()


def test_worker_generates_with_one_version_and_reloads_only_j_behind(running: Running) -> None:
    welcome = running.client.call(rp.Hello(protocol_version=rp.PROTOCOL_VERSION)).message
    assert isinstance(welcome, rp.Welcome) and welcome.server_id.startswith("worker0-")
    running.push(0)
    first = running.generate("a")
    assert isinstance(first, rp.GenerateResult) and first.request_id == "a" and first.weight_version == 0
    assert len(first.samples) == 4
    for sample in first.samples:
        assert len(sample.logprobs) == len(sample.token_ids) <= 4 and all(lp <= 0 for lp in sample.logprobs)
    running.push(1)  # one version behind: j=2 keeps the old weights
    assert running.generate("b").weight_version == 0
    running.push(2)  # two behind: reload before admitting the next request
    assert running.generate("c").weight_version == 2
    assert running.worker.reloads == 1
    # Same seed, same weights, same prompt: the same samples (batch-independent seeding).
    again = running.generate("d")
    assert again.weight_version == 2 and again.samples == running.generate("e").samples


def test_warm_up_covers_the_runs_shapes_and_results_carry_running_totals(running: Running) -> None:
    running.push(0)
    first = running.generate("a")  # the first weights: engine, then warm-up
    assert first.stats is not None and first.stats.compile_s > 0.0
    engine = running.worker.engine
    compiled = sum(engine.runner.num_compilations.values())
    second = running.generate("b")
    # The run's shapes (one group's rows, the task's prompt lengths) were compiled at start.
    assert sum(engine.runner.num_compilations.values()) == compiled
    a, b = first.stats, second.stats
    assert b is not None
    assert b.generated_tokens - a.generated_tokens == sum(len(s.token_ids) for s in second.samples)
    assert b.compile_s == a.compile_s and b.engine_s > a.engine_s
    assert b.active_s - a.active_s >= b.engine_s - a.engine_s > 0.0
    running.push(2)  # j=2 behind: the next request reloads first
    third = running.generate("c")
    assert third.weight_version == 2 and third.stats is not None
    assert third.stats.reloads == 1 and third.stats.reload_s > b.reload_s


def first_stop(tokenizer: Any, tokens: tuple[int, ...], stop: str) -> int | None:
    """How many tokens a sample keeps when it ends at the first text holding `stop` (None: never)."""
    for m in range(1, len(tokens) + 1):
        if stop in tokenizer.decode(tokens[:m]):
            return m
    return None


def test_stop_strings_end_a_sample_where_its_text_first_holds_one(running: Running) -> None:
    running.push(0)
    tokenizer = build_task(running.config).tokenizer
    # Seeded sampling: the same request with a stop string samples the same tokens up to it.
    free = running.generate("free", max_tokens=10, stop_token_ids=())
    tokens = free.samples[0].token_ids
    # A stop string of two or more tokens that the first sample's text holds only once it has
    # `cut` tokens (3 or more).
    stop, cut = next(
        (tokenizer.decode(tokens[start:end]), end)
        for end in range(3, len(tokens) + 1)
        for start in range(end - 2, -1, -1)
        if tokenizer.decode(tokens[start:end]) not in tokenizer.decode(tokens[: end - 1])
    )
    assert first_stop(tokenizer, tokens, stop) == cut
    stopped = running.generate("stop", max_tokens=10, stop_token_ids=(), stop_strings=(stop,))
    assert isinstance(stopped, rp.GenerateResult), stopped
    assert stopped.samples[0].token_ids == tokens[:cut]
    for sample, reference in zip(stopped.samples, free.samples, strict=True):
        keep = first_stop(tokenizer, reference.token_ids, stop)
        if keep is None:
            assert sample == reference
            continue
        assert sample.finish_reason == "stop"
        assert sample.token_ids == reference.token_ids[:keep]
        np.testing.assert_allclose(sample.logprobs, reference.logprobs[:keep], rtol=1e-6)
    # A stop string the text never holds changes nothing.
    never = running.generate("never", max_tokens=10, stop_token_ids=(), stop_strings=("@@",))
    assert never.samples == free.samples


def test_worker_rejects_a_bad_request_and_keeps_serving(running: Running) -> None:
    running.push(0)
    bad = running.generate("bad", prompt=(1, 999))  # token id outside the vocabulary
    assert isinstance(bad, rp.ErrorReply) and bad.code == "malformed" and "bad" in bad.message
    assert "999" in bad.message and "vocabulary" in bad.message
    assert isinstance(running.generate("good"), rp.GenerateResult)


def test_worker_survives_ten_thousand_hostile_messages_then_answers_a_correct_request(
    running: Running,
) -> None:
    running.push(0)
    assert isinstance(running.generate("warm"), rp.GenerateResult)
    sampling = rp.SamplingParams(max_tokens=1, temperature=0.0, seed=1)
    valid = [
        rp.encode(rp.GenerateRequest(request_id="v", prompt_token_ids=(1, 5, 13), sampling=sampling, n=1)),
        rp.encode(rp.Hello(protocol_version=rp.PROTOCOL_VERSION)),
    ]
    requests = list(hostile_requests(10_000, seed=5, valid=valid))
    assert any(parts[1:] == [deep_nesting(1000)] for parts in requests)
    replies = 0
    for start in range(0, len(requests), 2_000):  # in parts, to fail fast once the worker died
        replies += blast(running.address, requests[start : start + 2_000], settle_s=1.0, max_silent_waits=10)
        assert running.thread.is_alive() and not running.worker.errors, running.worker.errors
    assert replies > 5_000
    wait_until(lambda: running.worker.io.num_inflight == 0)  # the fuzz client's leftovers are cancelled
    good = running.generate("after")
    assert isinstance(good, rp.GenerateResult) and good.request_id == "after" and len(good.samples) == 4


def test_an_exception_from_one_message_is_answered_and_the_worker_keeps_serving(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    running.push(0)
    parse = rp.parse_request

    def parse_or_fail(parts: Any) -> Any:
        if len(parts) > 2 and parts[2].bytes == b"boom":
            raise RecursionError("maximum recursion depth exceeded while deserializing an object")
        return parse(parts)

    # Whatever the decoder (or a handler) raises on one message, the I/O thread lives on.
    monkeypatch.setattr(rp, "parse_request", parse_or_fail)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.linger = 0
    dealer.connect(running.address)
    try:
        dealer.send_multipart([(9).to_bytes(8, "little"), b"boom"])
        assert dealer.poll(10_000), "the failing message was not answered"
        error = rp.decode(dealer.recv_multipart()[1])
        assert (
            isinstance(error, rp.ErrorReply)
            and error.code == "internal"
            and "RecursionError" in error.message
        )
    finally:
        dealer.close(0)
    assert isinstance(running.generate("after"), rp.GenerateResult)


def test_hello_is_answered_while_the_engine_thread_waits_on_a_pull(behind_proxy: Any) -> None:
    running, proxy = behind_proxy
    running.push(0)
    assert running.generate("a").weight_version == 0
    proxy.block_pulls.set()
    running.push(1)  # j=1: the next request is admitted only after a reload
    rid = running.send("b")
    wait_until(lambda: proxy.held_pulls >= 1)
    assert running.worker.phase == "reloading"
    # The engine thread sits in the pull (its deadline is 60 s): the I/O thread answers anyway.
    other = rp.RpcClient(running.address, timeout_s=30, client_id="other")
    try:
        welcome = other.call(rp.Hello(protocol_version=rp.PROTOCOL_VERSION), retry=False).message
    finally:
        other.close()
    assert isinstance(welcome, rp.Welcome)
    assert running.worker.phase == "reloading" and running.worker.version == 0
    proxy.release()
    result = running.reply(rid)
    assert isinstance(result, rp.GenerateResult) and result.weight_version == 1


def test_a_failed_pull_keeps_the_old_weights_and_is_tried_again_later(
    tmp_path: pathlib.Path, free_tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    with running_server(tmp_path / "ps") as ps_address:
        proxy = PullBlockingProxy(ps_address)
        config = run_config(tmp_path, proxy.address, free_tcp_port, "workers.j=1")
        running = Running(config, rpc_timeout_s=0.5, pull_retries=1, reload_retry_s=0.5)
        running.pusher.close()
        running.pusher = ParamClient(ps_address, timeout_s=10)
        try:
            running.push(0)
            assert running.generate("a").weight_version == 0
            proxy.block_pulls.set()
            running.push(1)
            with caplog.at_level(logging.WARNING, logger="rlax.worker"):
                # The pull times out (twice: one retry): the request is served with version 0.
                stale = running.generate("b")
            assert isinstance(stale, rp.GenerateResult) and stale.weight_version == 0
            assert running.worker.num_failed_pulls >= 1 and "pulling version 1" in caplog.text
            proxy.release()
            wait_until(lambda: running.worker.version == 1)  # tried again after the backoff
            assert running.generate("c").weight_version == 1
        finally:
            proxy.release()
            running.close()
            proxy.close()


def test_a_disconnected_clients_request_is_aborted_and_its_blocks_freed(
    tmp_path: pathlib.Path, free_tcp_port: int
) -> None:
    with running_server(tmp_path / "ps") as ps_address:
        proxy = PullBlockingProxy(ps_address)
        config = run_config(tmp_path, proxy.address, free_tcp_port, "workers.j=1", "model.max_seq_len=512")
        running = Running(config, rpc_timeout_s=60.0)
        running.pusher.close()
        running.pusher = ParamClient(ps_address, timeout_s=10)
        # No start-up warm-up: each new block-table width compiles while the long request
        # below generates, so it is still generating seconds later; no EOS either.
        running.worker.warm_up = None
        running.worker.engine_config = dataclasses.replace(running.worker.engine_config, eos_token_ids=())
        try:
            running.push(0)
            assert isinstance(running.generate("warm"), rp.GenerateResult)
            worker, engine = running.worker, running.worker.engine
            free = engine.num_free_blocks
            gone = rp.RpcClient(running.address, timeout_s=30, client_id="gone")
            sampling = rp.SamplingParams(max_tokens=500, temperature=1.0, seed=1)
            gone.send_request(
                rp.GenerateRequest(request_id="long", prompt_token_ids=PROMPT, sampling=sampling, n=4)
            )
            wait_until(lambda: len(worker._admitted) == 1)
            tokens_before = worker.generated_tokens
            # Hold the engine thread in a reload (the version check while it generates sees v1)
            # with the long request in the engine, holding blocks.
            proxy.block_pulls.set()
            running.push(1)
            wait_until(lambda: proxy.held_pulls >= 1)
            assert worker.phase == "reloading"
            assert len(worker._admitted) == 1, "the long request finished before the reload began"
            assert engine.has_unfinished and engine.num_free_blocks < free
            gone.close()  # its client goes away
            wait_until(lambda: worker.io.num_cancelled == 1)
            proxy.release()
            wait_until(lambda: not engine.has_unfinished)
            assert worker.num_aborted == 1 and not worker._admitted
            assert worker.generated_tokens == tokens_before  # it never finished
            assert engine.num_free_blocks == free
            assert isinstance(running.generate("after"), rp.GenerateResult)
        finally:
            proxy.release()
            running.close()
            proxy.close()


def test_bfloat16_on_a_cpu_worker_computes_in_float32_and_says_so(
    tmp_path: pathlib.Path, free_tcp_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    # The trainer process applies the same rlax_model.dtype_policy: both sides compute alike.
    config = run_config(tmp_path, "tcp://127.0.0.1:9", free_tcp_port, "model.param_dtype=bfloat16")
    with caplog.at_level("WARNING", logger="rlax.model"):
        worker = Worker.from_run(config, 0)
    assert worker.model_config.param_dtype == "float32"
    assert worker.model_config.compute_dtype == "float32"
    assert "bfloat16" in caplog.text and "float32" in caplog.text


def test_with_fold_prefill_a_request_joining_a_decoding_batch_rides_in_its_call_uncompiled_nothing(
    tmp_path: pathlib.Path, free_tcp_port: int
) -> None:
    """`workers.fold_prefill`: the warm-up compiles the mixed steps (versions follow the
    newest, so requests join running ones), and a request admitted while another decodes
    is prefilled in the decode call, through those programs only."""
    with running_server(tmp_path / "ps") as ps_address:
        running = Running(run_config(tmp_path, ps_address, free_tcp_port, "workers.fold_prefill=true"))
        try:
            running.push(0)
            running.generate("warm")  # the first weights: engine, then warm-up
            engine = running.worker.engine
            assert engine.runner.mixed_programs  # compiled at the warm-up
            compiled, mixed = sum(engine.runner.num_compilations.values()), engine.num_mixed_calls
            # 8 rows: "short" and "long" fill them; "late" waits for "short" to finish and
            # joins while "long" decodes.
            ids = [
                running.send("short", max_tokens=2),
                running.send("long", max_tokens=11, stop_token_ids=()),
            ]
            ids.append(running.send("late", max_tokens=3))
            pending, replies = set(ids), []
            while pending:  # "late" finishes before "long"
                rid, reply = running.client.recv_reply(pending, timeout_s=120, operation="GenerateRequest")
                pending.discard(rid)
                replies.append(reply.message)
            assert all(isinstance(r, rp.GenerateResult) and len(r.samples) == 4 for r in replies)
            assert engine.num_mixed_calls > mixed
            assert sum(engine.runner.num_compilations.values()) == compiled
        finally:
            running.close()
