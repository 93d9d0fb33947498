"""`rlax-worker --config RUN.yaml --index I` as a real process: serves a request from the
run's parameter server, exits on SIGTERM; a rejected config exits with the config error code."""

import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
import zmq

import rlax_protocol as rp
from rlax_core.config import EXIT_CONFIG_ERROR, load_config
from rlax_data.task_from_config import build_task
from rlax_inference.worker_process import main
from rlax_model import init_params
from rlax_model.model_from_config import build_model_config
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server


def write_config(tmp_path: pathlib.Path, ps: str, port: int) -> pathlib.Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"run:\n  output_dir: {tmp_path / 'run'}\n"
        f"paramserver:\n  address: {ps}\n"
        f"workers:\n  count: 1\n  addresses: [tcp://127.0.0.1:{port}]\n  max_num_seqs: 8\n"
        "model:\n  max_seq_len: 16\n  hidden_size: 32\n  num_heads: 2\n  num_kv_heads: 1\n  num_layers: 1\n"
        "data:\n  task_args: {digits: 1}\n"
    )
    return path


# A worker process end to end (40 s; the end-to-end runs start workers the same way): `nox -s slow`.
@pytest.mark.slow
def test_rlax_worker_process(tmp_path: pathlib.Path, free_tcp_port: int):
    with running_server(tmp_path / "ps") as ps:
        path = write_config(tmp_path, ps, free_tcp_port)
        config = load_config(path)
        model_config = build_model_config(config, build_task(config).tokenizer)
        with ParamClient(ps, timeout_s=10) as client:
            client.push(jax.tree.map(np.asarray, init_params(model_config, jax.random.key(0))), 4)
        log = open(tmp_path / "worker.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlax_inference.worker_process", "--config", str(path), "--index", "0", "workers.j=2"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
        try:
            address = config.workers.addresses[0]
            with rp.RpcClient(address, timeout_s=300, client_id="cli-test") as rpc:
                request = rp.GenerateRequest(
                    request_id="q",
                    prompt_token_ids=(1, 5, 13),
                    sampling=rp.SamplingParams(max_tokens=3, temperature=0.0, seed=1),
                )
                rid = rpc.send_request(request)
                _, reply = rpc.recv_reply({rid}, timeout_s=300, operation="GenerateResult")
            result = reply.message
            assert isinstance(result, rp.GenerateResult), (tmp_path / "worker.log").read_text()
            assert result.weight_version == 4 and result.stats is not None and result.stats.compile_s > 0
            # Issue 29: a hostile request for a version nobody published (6; the newest is 4)
            # is held at most version_wait_s and answered; meanwhile another client's request
            # is answered at once (it used to get no answer for 30 s).
            with (
                rp.RpcClient(address, timeout_s=120, client_id="hostile") as hostile,
                rp.RpcClient(address, timeout_s=120, client_id="good") as good,
            ):
                held = hostile.send_request(
                    rp.GenerateRequest(
                        request_id="h",
                        prompt_token_ids=(1, 5, 13),
                        sampling=rp.SamplingParams(max_tokens=3, seed=2),
                        weight_version=6,
                    )
                )
                # A request refused at admission (n above max_num_seqs), sent after the held
                # one: its refusal, in the order the socket delivered them, says the worker
                # has taken the held request in (an event, not a sleep).
                too_many = hostile.send_request(
                    rp.GenerateRequest(
                        request_id="n",
                        prompt_token_ids=(1,),
                        n=10**9,
                        sampling=rp.SamplingParams(max_tokens=1),
                    )
                )
                _, refused = hostile.recv_reply({too_many}, timeout_s=120, operation="the refusal of n")
                assert isinstance(refused.message, rp.ErrorReply) and refused.message.code == "too_large"
                rid = good.send_request(request)
                _, answer = good.recv_reply({rid}, timeout_s=120, operation="GenerateResult")
                assert isinstance(answer.message, rp.GenerateResult) and answer.message.weight_version == 4
                assert [s.token_ids for s in answer.message.samples] == [s.token_ids for s in result.samples]
                # The order of events, not a time bound: when the good answer is here, the
                # hostile request is still held (a worker that served them in arrival order
                # would have answered it first).
                with pytest.raises(rp.ProtocolTimeoutError):
                    hostile.recv_reply({held}, timeout_s=0.05, operation="still held")
                _, late = hostile.recv_reply({held}, timeout_s=120, operation="version_unavailable")
                assert isinstance(late.message, rp.ErrorReply) and late.message.code == "version_unavailable"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 143, (tmp_path / "worker.log").read_text()
            # The socket was closed on the way out: the address can be bound again.
            socket = zmq.Context.instance().socket(zmq.ROUTER)
            socket.bind(address)
            socket.close(0)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def test_rlax_worker_exits_with_the_config_error_code_on_a_rejected_config(
    tmp_path: pathlib.Path, free_tcp_port: int, capsys
):
    # Rejected before the worker contacts anyone (nothing listens on port 9).
    path = write_config(tmp_path, "tcp://127.0.0.1:9", free_tcp_port)
    assert main(["--config", str(path), "--index", "0", "workers.attention=fast"]) == EXIT_CONFIG_ERROR
    assert "EngineConfig.attention" in capsys.readouterr().err
    assert main(["--config", str(path), "--index", "3", "--check-config"]) == EXIT_CONFIG_ERROR
    assert "--index 3" in capsys.readouterr().err
    bad = ["--config", str(path), "--index", "0", "workers.max_inflight_requests=1", "--check-config"]
    assert main(bad) == EXIT_CONFIG_ERROR
    assert "max_inflight_requests" in capsys.readouterr().err
    assert main(["--config", str(path), "--index", "0", "--check-config"]) == 0
