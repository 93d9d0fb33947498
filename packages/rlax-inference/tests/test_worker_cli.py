"""The `rlax-worker` command as a real process: serves a request, then exits cleanly on SIGTERM."""

import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from tiny_model import CONFIG, PARAMS, naive_greedy

import rlax_protocol as rp
from rlax_paramserver import ParamClient
from rlax_paramserver.testing import running_server


def test_rlax_worker_process(tmp_path: pathlib.Path):
    with running_server(tmp_path / "ps") as ps:
        with ParamClient(ps, timeout_s=10) as client:
            client.push(jax.tree_util.tree_map(np.asarray, PARAMS), 4)
        (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(CONFIG)))
        (tmp_path / "engine.json").write_text(
            json.dumps(
                {
                    "block_size": 8,
                    "num_blocks": 96,
                    "max_num_seqs": 32,
                    "max_num_batched_tokens": 512,
                    "max_model_len": 128,
                    "eos_token_ids": [],
                }
            )
        )
        ready = tmp_path / "address"
        log = open(tmp_path / "worker.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlax_inference.worker", "--paramserver", ps, "--ready-file", str(ready),
             "--model-config", str(tmp_path / "model.json"), "--engine-config", str(tmp_path / "engine.json")],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()
                assert time.monotonic() < deadline, "worker did not start"
                time.sleep(0.05)
            with rp.RpcClient(ready.read_text(), timeout_s=10, client_id="cli-test") as rpc:
                msg = rp.GenerateRequest(
                    request_id="q",
                    prompt_token_ids=(5, 6, 7),
                    sampling=rp.SamplingParams(max_tokens=4, temperature=0.0),
                )
                rid = rpc.send_request(msg)
                _, reply = rpc.recv_reply({rid}, timeout_s=120, operation="GenerateResult")
            result = reply.message
            assert isinstance(result, rp.GenerateResult) and result.weight_version == 4
            assert list(result.samples[0].token_ids) == naive_greedy(PARAMS, [5, 6, 7], 4)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def test_rlax_worker_exits_with_the_config_error_code_on_a_rejected_config(tmp_path: pathlib.Path, capsys):
    from rlax_inference.worker import EXIT_CONFIG_ERROR, main

    engine = tmp_path / "engine.json"
    engine.write_text(json.dumps({"attention": "fast"}))
    # Rejected before the worker contacts anyone (nothing listens on port 9).
    assert main(["--paramserver", "tcp://127.0.0.1:9", "--engine-config", str(engine)]) == EXIT_CONFIG_ERROR
    assert "invalid config" in capsys.readouterr().err
    engine.write_text(json.dumps({"no_such_field": 1}))
    assert main(["--paramserver", "tcp://127.0.0.1:9", "--engine-config", str(engine)]) == EXIT_CONFIG_ERROR
    assert "no_such_field" in capsys.readouterr().err
    # Longer sequences than the model's positions: rejected once the weights (and so the
    # model) are known, still as a config error, never as a crash to restart.
    with running_server(tmp_path / "ps") as ps:
        with ParamClient(ps, timeout_s=10) as client:
            client.push(jax.tree_util.tree_map(np.asarray, PARAMS), 1)
        (tmp_path / "model.json").write_text(json.dumps(dataclasses.asdict(CONFIG)))
        engine.write_text(json.dumps({"max_model_len": 4 * CONFIG.max_position_embeddings}))
        argv = [
            "--paramserver",
            ps,
            "--model-config",
            str(tmp_path / "model.json"),
            "--engine-config",
            str(engine),
        ]
        assert main(argv) == EXIT_CONFIG_ERROR
        assert "max_position_embeddings" in capsys.readouterr().err
