"""`rlax eval`: pass@k of a run's checkpoint on its task's evaluation prompts, with the
inference engine in this process; and `engine_sampler`, the sampler factory that
`rlax curate prefilter --sampler rlax_controller.evaluation:engine_sampler` uses."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence
from typing import Any

from rlax_controller.config import RunConfig, load_config

__all__ = ["EngineSampler", "engine_sampler", "load_run_params", "run"]

log = logging.getLogger("rlax.eval")


def load_run_params(config: RunConfig, tokenizer: Any, *, step: int | None = None) -> tuple[Any, Any, int]:
    """(model config, policy params, step) of the run's newest RL checkpoint (or `step`);
    the initial weights (step -1) when the run has no checkpoint yet."""
    from rlax_controller.models import initial_params
    from rlax_controller.trainer_service import learner_config
    from rlax_trainer import Learner
    from rlax_trainer.checkpoint import CheckpointManager

    model_config, init = initial_params(config, tokenizer)
    folder = config.output_dir / "checkpoints" / "rl"
    if not folder.is_dir():
        if step is not None:
            raise FileNotFoundError(f"{folder}: no checkpoints, so step {step} cannot be loaded")
        return model_config, init, -1
    template = Learner(model_config, learner_config(config, mode="rl"), init, seed=config.run.seed)
    manager = CheckpointManager(folder, max_to_keep=config.trainer.checkpoint_keep, asynchronous=False)
    try:
        restored = manager.restore(template.state, step=step)
    finally:
        manager.close()
    if restored is None:
        return model_config, init, -1
    state, info = restored
    return model_config, state.params["policy"], info.step


class EngineSampler:
    """`rlax_data.Sampler` over `rlax_inference.LLMEngine`: prompt texts in, completion texts out."""

    def __init__(
        self, config: RunConfig, task: Any, model_config: Any, params: Any, *, seed: int = 0
    ) -> None:
        from rlax_inference.engine import EngineConfig, LLMEngine

        max_len = config.model.max_seq_len
        self.engine = LLMEngine(
            model_config,
            params,
            EngineConfig(
                num_blocks=config.workers.max_batch_seqs * (-(-max_len // 16) + 1) + 8,
                max_num_seqs=config.workers.max_batch_seqs,
                max_model_len=max_len,
                attention=config.workers.attention,
            ),
        )
        self.config = config
        self.task = task
        self.seed = seed

    def __call__(self, prompts: Sequence[str], n: int) -> list[list[str]]:
        from rlax_inference.sequence import SamplingParams

        data = self.config.data
        params = [
            SamplingParams(
                n=n,
                temperature=self.config.eval.temperature,
                top_p=data.top_p,
                top_k=data.top_k,
                max_tokens=data.max_new_tokens,
                seed=self.seed + i,
                stop_token_ids=self.task.stop_token_ids,
            )
            for i in range(len(prompts))
        ]
        outputs = self.engine.generate([self.task.encode_text(p) for p in prompts], params)
        result = []
        for output in outputs:
            if output.error:
                raise ValueError(f"generation failed for request {output.request_id}: {output.error}")
            ordered = sorted(output.outputs, key=lambda c: c.sample_index)
            result.append([self.task.decode(c.tokens) for c in ordered])
        return result


def engine_sampler(config: str, step: str = "", **overrides: str) -> EngineSampler:
    """Factory for `rlax curate prefilter --sampler rlax_controller.evaluation:engine_sampler
    --sampler-arg config=RUN.yaml [--sampler-arg step=N]`: the run's newest weights."""
    from rlax_controller.tasks import build_task

    run_config = load_config(config, [f"{k}={v}" for k, v in overrides.items()])
    task = build_task(run_config)
    model_config, params, _ = load_run_params(run_config, task.tokenizer, step=int(step) if step else None)
    return EngineSampler(run_config, task, model_config, params, seed=run_config.eval.seed)


def run(config: RunConfig, *, checkpoint: str = "", out: str = "") -> int:
    from rich.console import Console

    from rlax_controller.tasks import build_task
    from rlax_data import evaluate

    task = build_task(config)
    records = task.eval_records()
    if not records:
        raise SystemExit("rlax eval: eval.num_prompts is 0, nothing to evaluate")
    model_config, params, step = load_run_params(
        config, task.tokenizer, step=int(checkpoint) if checkpoint else None
    )
    sampler = EngineSampler(config, task, model_config, params, seed=config.eval.seed)
    out_dir = pathlib.Path(out) if out else config.output_dir / "eval" / f"step_{step}"
    report = evaluate(
        records, sampler, task.verifier, n=config.eval.n_samples, ks=config.eval.pass_k, out_dir=out_dir
    )
    console = Console()
    console.print(
        f"evaluated {'initial weights' if step < 0 else f'checkpoint step {step}'} on {len(records)} prompts"
    )
    console.print((out_dir / "eval.md").read_text() if (out_dir / "eval.md").exists() else str(report))
    console.print(f"report: {out_dir}")
    return 0
