"""The demo shrunk for integration tests: a 1-layer model, 4 prompts x 4 samples a step, no
evaluation, the verifier as a service, short timeouts. Overrides on `configs/demo.yaml`,
shared by the local end-to-end tests and the Ray launcher's tests."""

from __future__ import annotations

import pathlib

DEMO_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"

TINY_RUN = [
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=64",
    "model.max_seq_len=16",
    "data.task_args={digits: 1}",
    "data.group_size=4",
    "data.prompts_per_step=4",
    "data.max_new_tokens=4",
    "workers.count=2",
    "workers.max_num_seqs=16",
    "trainer.sft_steps=2",
    "trainer.sft_batch=16",
    "trainer.preset=rloo",
    "eval.num_prompts=0",
    "verifier.mode=service",
    "controller.heartbeat_timeout_s=15",
    "controller.request_timeout_s=60",
    "supervisor.max_restarts=10",
]
