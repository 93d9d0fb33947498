"""A multi-host trainer on loopback: `rlax launch` with `trainer.hosts=2` starts the trainer
as a gang of two processes joined by `jax.distributed` (gloo collectives on CPU, one device
each, FSDP over both), beside the parameter server, controller, workers and verifier.

- The gang trains every accepted rollout exactly once and ends with the weights of a
  one-process trainer (`trainer.hosts=1`) up to float32 summation order.
- `trainer1` SIGKILLed mid-run: the supervisor stops `trainer0` too, restarts both from the
  last checkpoint, and the run ends with the undisturbed gang's prompts and exact weights.
- A member whose peer dies exits non-zero instead of hanging.

The whole-run tests are slow (`nox -s slow`): the default session is near CI's limit.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
from typing import Any

import numpy as np
import pytest
from test_end_to_end import launch
from tiny_run import DEMO_CONFIG

from rlax_paramserver.persist import read_state

STEPS = 6
BATCH = 16  # data.prompts_per_step x data.group_size of tests/tiny_run.py
# One worker (tiny_run has two): a launch on the 2-core CI machine is mostly compiling, and
# the trainer gang is the subject here.
GANG = [f"run.steps={STEPS}", "trainer.k=0", "workers.j=1", "workers.count=1", "trainer.hosts=2"]
# Where the two trainers' weights may differ. Both compute the same float32 math; the gang
# splits each parameter and the batch over two devices, so sums (gradients, norms, the
# loss) are reduced in another order: ~1e-7 relative per reduction. Adam divides each
# gradient by its running RMS, so a rounding difference moves a weight by at most a small
# fraction of the learning rate (3e-4 for RL, 3e-3 for the 2 SFT steps) per step. 1e-5 is
# 30x below a single RL step's typical move (a skipped, repeated or mis-sharded update
# shows up as ~lr), and measured differences are ~1e-6 (printed).
WEIGHTS_ATOL = 1e-5


def published(out: pathlib.Path) -> tuple[int, dict[str, np.ndarray]]:
    """The newest weights the parameter server persisted: (version, name -> array)."""
    path = sorted((out / "paramserver").glob("*.rlaxw"))[-1]
    state = read_state(path)
    frames = iter(state.frames)
    arrays = {}
    for tensor in state.manifest.tensors:
        count = max(1, math.ceil(tensor.nbytes / state.manifest.chunk_bytes))
        data = b"".join(bytes(next(frames)) for _ in range(count))
        arrays[tensor.name] = np.frombuffer(data, dtype=tensor.dtype).reshape(tensor.shape)
    return state.version, arrays


def max_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)


def check_trained_exactly_once(run: dict[str, Any]) -> None:
    """The trainer (process 0's log) trained exactly the rollouts the controller accepted,
    each once, at every step."""
    controller = {r["step"]: r["rollout_ids"] for r in run["train"]}
    trainer = {r["step"]: r["rollout_ids"] for r in run["trainer"]}
    assert sorted(controller) == list(range(1, STEPS + 1))
    assert trainer == controller
    ids = [i for step in sorted(trainer) for i in trainer[step]]
    assert len(ids) == len(set(ids)) == STEPS * BATCH


def started(run: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in run["events"] if e["event"] == "start" and e["name"] == name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The gang and the one-process reference, launched side by side (on loopback, each on
    its own free ports): a launch spends much of its time starting up and waiting, so two
    at once take far less than two in turn."""
    root = tmp_path_factory.mktemp("gang")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gang = pool.submit(launch, root / "gang", root / "jax_cache", *GANG)
        single = pool.submit(launch, root / "single", root / "jax_cache_single", *GANG, "trainer.hosts=1")
        return {"root": root, "cache": root / "jax_cache", "gang": gang.result(), "single": single.result()}


@pytest.mark.slow  # two whole runs: in `nox -s slow` (the default suite is near CI's limit)
def test_a_two_process_trainer_gang_trains_every_accepted_rollout_once(runs: dict[str, Any]) -> None:
    run = runs["gang"]
    for name in ("trainer0", "trainer1"):
        assert len(started(run, name)) == 1, f"{name} did not run exactly once"
    assert not started(run, "trainer")  # no lone trainer beside the gang
    assert not [e for e in run["events"] if e["event"] in ("gang_stop", "gang_restart")]
    joined = (runs["root"] / "gang" / "logs" / "trainer1.log").read_text()
    assert "joined the trainer gang as process 1 of 2" in joined and "2 devices in all" in joined
    check_trained_exactly_once(run)
    assert all(v == r["step"] - 1 for r in run["train"] for v in r["rollout_versions"])  # k = 0


@pytest.mark.slow  # two whole runs: in `nox -s slow` (the default suite is near CI's limit)
def test_the_gang_ends_with_the_weights_of_a_one_process_trainer(runs: dict[str, Any]) -> None:
    check_trained_exactly_once(runs["single"])
    assert (
        runs["gang"]["train"][-1]["consumed_prompt_ids"] == runs["single"]["train"][-1]["consumed_prompt_ids"]
    )
    version, gang = published(runs["root"] / "gang")
    single_version, single = published(runs["root"] / "single")
    assert version == single_version == STEPS
    difference = max_difference(gang, single)
    print(f"hosts=2 vs hosts=1: max |weight difference| = {difference:.3g}")
    assert difference <= WEIGHTS_ATOL


@pytest.mark.slow
def test_a_sigkilled_member_restarts_the_gang_from_its_checkpoint(runs: dict[str, Any]) -> None:
    run = launch(runs["root"] / "chaos", runs["cache"], *GANG, kills=[(3, "trainer1")])
    assert run["killed"] == ["trainer1"]
    [restart] = [e for e in run["events"] if e["event"] == "gang_restart"]
    assert restart["members"] == ["trainer0", "trainer1"]
    # trainer0 is stopped by the supervisor, unless the runtime's loss of its peer ends it
    # first (then both exits land in one poll and either may be named the cause).
    exits = {e["name"]: e["code"] for e in run["events"] if e["event"] == "exit" and "gang" in e}
    assert exits["trainer1"] == -signal.SIGKILL and sorted(exits) == ["trainer0", "trainer1"]
    for name in ("trainer0", "trainer1"):
        assert [e["restarts"] for e in started(run, name)] == [0, 1]
    resumed = (runs["root"] / "chaos" / "logs" / "trainer0.log").read_text()
    assert "resumed from checkpoint step" in resumed
    check_trained_exactly_once(run)
    assert [r["consumed_prompt_ids"] for r in run["train"]] == [
        r["consumed_prompt_ids"] for r in runs["gang"]["train"]
    ]
    # The same programs on the same mesh from the same checkpoint and batches: bit for bit.
    version, weights = published(runs["root"] / "chaos")
    assert version == STEPS
    assert max_difference(weights, published(runs["root"] / "gang")[1]) == 0.0


MEMBER = """
import sys, threading
from rlax_core.config import load_config
from rlax_trainer.gang import join_gang

process_id, port = int(sys.argv[1]), sys.argv[2]
config = load_config(sys.argv[3], ["trainer.hosts=2", f"trainer.coordinator=127.0.0.1:{port}",
                                   "controller.heartbeat_timeout_s=30", "controller.request_timeout_s=600"])
gang = join_gang(config, process_id)
for n in (0, 5, 1024, 1025, 5000):  # across the padding buckets
    payload = bytes(range(256)) * (n // 256) + bytes(n % 256)
    assert gang.broadcast_bytes(payload if gang.leader else None) == payload, n
assert gang.broadcast_flag(True if gang.leader else None) is True
assert gang.broadcast_flag(False if gang.leader else None) is False
print("ready", flush=True)
if not gang.leader:
    threading.Event().wait()  # the test kills process 1 here: it never joins the next collective
gang.broadcast_bytes(b"never" if gang.leader else None)
print("broadcast returned", flush=True)
"""


@pytest.mark.slow  # in `nox -s slow`: the default suite stays under CI's 15 minutes
def test_a_member_whose_peer_dies_exits_nonzero_instead_of_hanging(tmp_path: pathlib.Path) -> None:
    """Broadcasts reach every member; then process 1 is SIGKILLed while process 0 waits in a
    collective that process 1 never joins: the JAX runtime ends process 0 with an error.
    The heartbeat timeout (30 s) must only outlast a loaded machine's pauses; the join's
    (600 s) and the wait's (600 s) only bound a hang."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(MEMBER), str(i), str(port), str(DEMO_CONFIG)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    try:
        assert procs[1].stdout is not None
        for line in procs[1].stdout:
            if line.startswith("ready"):
                break
        else:
            raise AssertionError(f"process 1 exited with {procs[1].wait()} before the broadcasts passed")
        procs[1].kill()
        output = procs[0].communicate(timeout=600)[0]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    assert "ready" in output, output[-3000:]
    assert "broadcast returned" not in output
    assert procs[0].returncode != 0, output[-3000:]
