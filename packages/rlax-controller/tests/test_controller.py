"""The controller process logic with real sockets: stand-in workers and a trainer client."""

from __future__ import annotations

import pathlib
import threading
from typing import Any

from rlax_controller.config import load_config
from rlax_controller.controller import Controller
from rlax_controller.links import ControlClient
from rlax_controller.messages import (
    BatchRequest,
    NoBatchYet,
    RunComplete,
    TrainBatch,
    decode_control,
    encode_control,
)
from rlax_controller.metrics import latest_per_step, read_metrics
from rlax_controller.scheduling import PromptItem
from rlax_protocol.errors import ProtocolTimeoutError


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


class ControllerThread:
    def __init__(self, config: Any, toy: Any, workers: list[Any]) -> None:
        evals = [PromptItem(f"e{i}", (9, i + 1), record=i) for i in range(3)]
        self.controller = Controller(
            config,
            source=toy.Source(),
            scorer=toy.Scorer(),
            eval_items=evals,
            worker_addresses=[w.address for w in workers],
        )
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.code = self.controller.run(stop_after_complete_s=0.1, max_seconds=60)
        except BaseException as error:  # surfaced by the test
            self.error = error
        finally:
            self.controller.close()

    def join(self) -> None:
        self.thread.join(timeout=60)
        if self.error:
            raise self.error


def train(
    address: str, workers: list[Any], start_step: int = 0, stop_at: int | None = None
) -> dict[int, list[str]]:
    """A trainer stand-in: asks for batches, 'trains', advances the workers' weights."""
    client = ControlClient(address, encode=encode_control, decode=decode_control, timeout_s=5.0)
    step = start_step
    trained: dict[int, list[str]] = {}
    try:
        while stop_at is None or step < stop_at:
            try:
                reply = client.call(BatchRequest(trainer_step=step, metrics={"loss": 0.5}))
            except ProtocolTimeoutError:
                continue  # a busy controller (it draws the summary plot at the end): ask again
            if isinstance(reply, RunComplete):
                assert reply.final_step == step
                break
            if isinstance(reply, NoBatchYet):
                threading.Event().wait(reply.retry_after_s)
                continue
            assert isinstance(reply, TrainBatch) and reply.step == step
            assert all(step - r.policy_version <= 1 for r in reply.rollouts)
            trained[step] = list(reply.rollout_ids)
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
    assert (
        ct.controller.scheduler.counters["groups_reassigned"]
        + ct.controller.scheduler.counters.get("requests_timed_out", 0)
        >= 0
    )


def test_hung_worker_requests_time_out_and_go_elsewhere(
    tmp_path: pathlib.Path, toy: Any, fake_workers: Any
) -> None:
    workers = fake_workers(2)
    workers[0].swallow = True
    config = make_config(
        tmp_path, toy.port(), **{"eval.num_prompts": 0, "controller.request_timeout_s": 0.5, "run.steps": 3}
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
    trained.update(train(config.controller.address, workers, start_step=3))
    second.join()
    assert sorted(trained) == list(range(6))
    records = latest_per_step(read_metrics(config.output_dir / "metrics.jsonl", kind="train"))
    consumed = [p for r in records for p in r["consumed_prompt_ids"]]
    assert consumed == [f"p{i}" for i in range(18)]
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
