"""Sharded updates equal the single-device update (subprocesses: the device count is fixed at start-up)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from rlax_protocol.ports import reserve_port

SCRIPT = pathlib.Path(__file__).with_name("sharded_update.py")


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return env


def _compare(path: pathlib.Path, tag: str) -> None:
    data = np.load(path, allow_pickle=False)
    keys = [k.split("|", 1)[1] for k in data.files if k.startswith("single|")]
    assert len(keys) > 5
    for k in keys:
        np.testing.assert_allclose(
            data[f"{tag}|{k}"], data[f"single|{k}"], atol=1e-5, rtol=0, err_msg=f"{tag} {k}"
        )


def test_fsdp4_and_tensor_parallel_match_single_device(tmp_path):
    out = tmp_path / "local.npz"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "local", str(out)],
        env=_env(4),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _compare(out, "fsdp4")
    _compare(out, "fsdp2_tp2")


def _free_port() -> int:
    return reserve_port()


@pytest.mark.slow
def test_two_processes_joined_by_jax_distributed_match(tmp_path):
    out = tmp_path / "multihost.npz"
    port = _free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                "multihost",
                str(out),
                str(i),
                "2",
                str(port),
                str(tmp_path / "ckpt"),
            ],
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    _compare(out, "multihost")
