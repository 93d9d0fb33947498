"""RLAX's update on the batches its run trained on, replayed from the run's batch journal: the
RLAX half of `bench_real_model.py`'s same-sequences training comparison, in a process of its
own (beside `real_model_trl_replay.py`, which gives TRL the same batches).

    python benchmarks/real_model_rlax_replay.py CONFIG.json

CONFIG.json: {"rlax_config": path, "overrides": [...], "out": path, "steps": N, "journal": path}.
The trainer's own path (`rlax_trainer.trainer_process`): the same initial weights and `Learner`
config, each journaled `TrainBatch` collated to `model.max_seq_len` and passed to
`Learner.update`, whose seconds are timed as the run times them (`train_seconds`: the update
without compiling a new program). Unlike the run's trainer, nothing else runs beside it: no
worker sharing the cores, no checkpoint or push between steps. Writes
`out/rlax_replay.json`: per step the update's seconds, the batch's real tokens (prompt +
completion of every rollout, no padding) and the positions the packed passes computed.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys
import time

from child_result import write_result


def main(spec_path: str) -> None:
    from rlax_core.config import load_config
    from rlax_data.task_from_config import build_task
    from rlax_model import dtype_policy
    from rlax_model.model_from_config import initial_params
    from rlax_protocol.control_messages import TrainBatch, decode_control
    from rlax_trainer import Learner, collate
    from rlax_trainer.journal import BatchJournal
    from rlax_trainer.trainer_process import learner_config

    spec = json.loads(pathlib.Path(spec_path).read_text())
    config = load_config(spec["rlax_config"], spec["overrides"])
    out, steps = pathlib.Path(spec["out"]), int(spec["steps"])
    journal = BatchJournal(spec["journal"])
    task = build_task(config)
    pad_id = int(task.tokenizer.pad_id)
    model_config, init = initial_params(config, task.tokenizer)
    if config.trainer.sft_steps:
        raise RuntimeError("the replay starts from the initial weights: an SFT warm start is not replayed")
    learner = Learner(
        dtype_policy(model_config), learner_config(config, mode="rl"), init, seed=config.run.seed
    )
    del init
    rows = []
    started_all = time.perf_counter()
    for step in range(steps):
        payload = journal.read(step)
        if payload is None:
            raise RuntimeError(f"{journal.directory}: no entry for step {step}")
        batch = decode_control(payload)
        if not isinstance(batch, TrainBatch) or batch.step != step:
            raise RuntimeError(f"{journal.directory}: the entry of step {step} is not its TrainBatch")
        g = batch.group_size
        groups = [batch.rollouts[i : i + g] for i in range(0, len(batch.rollouts), g)]
        arrays = collate(groups, pad_id=pad_id, seq_len=config.model.max_seq_len)
        started = time.perf_counter()
        metrics = learner.update(arrays)
        compile_s = metrics.get("trainer_compile_seconds", 0.0)
        rows.append(
            {
                "step": step + 1,
                "train_s": time.perf_counter() - started - compile_s,
                "compile_s": compile_s,
                "tokens": float(arrays.valid.sum()),
                "completion_tokens": float(arrays.mask.sum()),
                "positions": metrics.get("train_computed_tokens", math.nan),
                "loss": metrics.get("loss", math.nan),
            }
        )
    write_result(out, "rlax_replay", {"steps": rows, "wall_s": time.perf_counter() - started_all})


if __name__ == "__main__":
    main(sys.argv[1])
