"""`rlax eval`: pass@k of a run's weights on its task's evaluation prompts, with the
inference engine in this process; and `engine_sampler`, the sampler factory that
`rlax curate prefilter --sampler rlax_inference.eval_process:engine_sampler` uses."""

from __future__ import annotations

import argparse
import logging
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from rlax_core.cli import component_main, select_platform
from rlax_core.config import RunConfig, load_config, published_state_dir

__all__ = ["EngineSampler", "engine_sampler", "load_run_params", "main", "run"]

log = logging.getLogger("rlax.eval")


def load_run_params(config: RunConfig, tokenizer: Any, *, weights: str = "") -> tuple[Any, Any, str]:
    """(model config, policy params, description) of the weights to evaluate.

    `weights`: an HF checkpoint folder (e.g. one written by `rlax convert to-hf`); by default
    the run's newest published version, read from the parameter server's state folder
    (`paramserver.state_dir`, default `<run>/paramserver`, or its folder in memory while the
    run is live with `paramserver.storage: memory`) — the same bytes the workers
    pulled; the initial weights when nothing was published yet. A trainer checkpoint of an
    earlier step is read by the trainer's package: `rlax convert to-hf --step N` first.
    """
    import jax.numpy as jnp

    from rlax_inference.lora_weights import as_params
    from rlax_model import dtype_policy, load_hf_checkpoint
    from rlax_model.lora import merge_adapters
    from rlax_model.model_from_config import build_model_config, initial_params
    from rlax_paramserver.persist import load_states
    from rlax_protocol.codec import decode_tree
    from rlax_protocol.lora_versions import LORA_SCALE, lora_base_of

    if weights:
        model_config, params = load_hf_checkpoint(weights, param_dtype=config.model.param_dtype)
        return dtype_policy(model_config), params, f"weights {weights}"
    states, error = load_states(published_state_dir(config), 1)
    if error:
        log.warning("newer published versions are corrupt: %s", error)
    if not states:
        model_config, params = initial_params(config, tokenizer)
        return dtype_policy(model_config), params, "initial weights"
    model_config = dtype_policy(build_model_config(config, tokenizer))
    dtype = model_config.param_jnp_dtype
    state = states[-1]  # the newest; before it, the base it names if it holds adapters only
    tree = decode_tree(state.manifest, state.frames)
    base_version = lora_base_of(state.metadata, state.version)
    if base_version is None:
        return model_config, as_params(tree, dtype), f"published version {state.version}"
    base = next((s for s in states if s.version == base_version), None)
    if base is None:
        raise FileNotFoundError(
            f"published version {state.version} holds LoRA adapters on base version {base_version}, "
            f"whose state file is not in {published_state_dir(config)}"
        )
    params = merge_adapters(
        as_params(decode_tree(base.manifest, base.frames), dtype),
        as_params(tree["lora"], jnp.float32),
        float(state.metadata[LORA_SCALE]),
    )
    return model_config, params, f"published version {state.version} (LoRA on version {base_version})"


class EngineSampler:
    """`rlax_data.Sampler` over `rlax_inference.LLMEngine`: prompt texts in, completion texts out.

    For a multi-turn run (`agent.environment` set) each sample is a trajectory that the
    worker's agent loop (`rlax_inference.agent_loop.AgentLoop`) runs in this process, with
    the run's environment, tool format and limits; its completion text is the last model
    turn, the final answer the verifier scores. An environment starts from the prompt's
    record, not its text: `render` then gives the record as JSON, and callers that render
    prompts (`rlax_data.evaluate`, `prefilter_by_pass_rate`) pass it.
    """

    def __init__(
        self, config: RunConfig, task: Any, model_config: Any, params: Any, *, seed: int = 0
    ) -> None:
        from rlax_inference.engine import EngineConfig, LLMEngine
        from rlax_inference.worker_process import engine_config_fields
        from rlax_inference.worker_requests import TailText

        # The workers' engine, as the run configures it (seeded by `seed` alone: an
        # evaluation's samples do not depend on which worker index it would have been).
        fields = {**engine_config_fields(config), "seed": 0}
        detokenize = TailText(task.tokenizer) if config.agent.enabled else None
        self.engine = LLMEngine(model_config, params, EngineConfig(**fields), detokenize=detokenize)
        self.config = config
        self.task = task
        self.seed = seed
        self.trajectories: list[dict[str, Any]] = []
        """Per multi-turn sample drawn so far: its turns, tool calls, tool errors and end."""

    @property
    def render(self) -> Any:
        """Record -> the prompt this sampler takes: the record as JSON for a multi-turn run
        (its environment starts from the record), None (the record's prompt text) otherwise."""
        if not self.config.agent.enabled:
            return None
        return lambda record: msgspec.json.encode(record).decode()

    def _params(self, index: int, n: int) -> Any:
        from rlax_inference.sequence import SamplingParams

        data = self.config.data
        return SamplingParams(
            n=n,
            temperature=self.config.eval.temperature,
            top_p=data.top_p,
            top_k=data.top_k,
            max_tokens=data.max_new_tokens,
            seed=self.seed + index,
            stop_token_ids=self.task.stop_token_ids,
        )

    def __call__(self, prompts: Sequence[str], n: int) -> list[list[str]]:
        if self.config.agent.enabled:
            return self._trajectories(prompts, n)
        params = [self._params(i, n) for i in range(len(prompts))]
        outputs = self.engine.generate([self.task.encode_text(p) for p in prompts], params)
        result = []
        for output in outputs:
            if output.error:
                raise ValueError(f"generation failed for request {output.request_id}: {output.error}")
            ordered = sorted(output.outputs, key=lambda c: c.sample_index)
            result.append([self.task.decode(c.tokens) for c in ordered])
        return result

    def _trajectories(self, prompts: Sequence[str], n: int) -> list[list[str]]:
        """Run `n` trajectories per prompt (a record's JSON, from `render`) to their end, as
        a worker runs them; the last model turn of each."""
        import rlax_protocol as rp
        from rlax_data.agent_turns import last_model_turn
        from rlax_data.datasets import Record
        from rlax_inference.agent_loop import AgentLoop

        agent = self.config.agent
        loop = AgentLoop(
            lambda: self.engine, self.task.agent_turns(), max_model_len=self.engine.config.max_model_len
        )
        try:
            for key, prompt in enumerate(prompts):
                try:
                    record = msgspec.json.decode(prompt, type=Record)
                except (msgspec.DecodeError, msgspec.ValidationError) as error:
                    raise ValueError(
                        f"prompt {key}: a multi-turn sampler takes records as JSON (its `render`), "
                        f"got {prompt[:60]!r} ({error})"
                    ) from None
                params = self._params(key, n)
                request = rp.GenerateRequest(
                    request_id=f"eval-{key}",
                    prompt_token_ids=tuple(self.task.encode_prompt(record)),
                    sampling=rp.SamplingParams(max_tokens=params.max_tokens, seed=params.seed),
                    n=n,
                    agent=rp.AgentSpec(
                        environment=agent.environment,
                        record=prompt,
                        max_turns=agent.max_turns,
                        max_total_tokens=agent.max_total_tokens or self.config.model.max_seq_len,
                        tool_timeout_s=agent.tool_timeout_s,
                    ),
                )
                loop.start(key, request, params)
            done: dict[int, list[Any]] = {}
            while len(done) < len(prompts):
                finished = []
                if self.engine.has_unfinished:
                    for output in self.engine.step():
                        finished += loop.on_output(output)
                elif loop.waiting_on_environment:
                    time.sleep(0.001)  # every trajectory waits on a tool: nothing to step
                finished += loop.poll()
                for key, _, samples, _ in finished:
                    done[key] = samples  # in sample order
        finally:
            loop.close()
        result = []
        for key in range(len(prompts)):
            texts = []
            for sample in done[key]:
                self.trajectories.append(
                    {"turns": sample.turns, "tool_calls": sample.tool_calls,
                     "tool_errors": sample.tool_errors, "end": sample.end}
                )  # fmt: skip
                texts.append(self.task.decode(last_model_turn(sample.token_ids, sample.model_mask)))
            result.append(texts)
        return result


def engine_sampler(config: str, weights: str = "", **overrides: str) -> EngineSampler:
    """Factory for `rlax curate prefilter --sampler rlax_inference.eval_process:engine_sampler
    --sampler-arg config=RUN.yaml [--sampler-arg weights=HF_FOLDER]`: the run's newest
    published weights by default."""
    from rlax_data.task_from_config import build_task

    run_config = load_config(config, [f"{k}={v}" for k, v in overrides.items()])
    task = build_task(run_config)
    model_config, params, _ = load_run_params(run_config, task.tokenizer, weights=weights)
    return EngineSampler(run_config, task, model_config, params, seed=run_config.eval.seed)


def run(config: RunConfig, *, weights: str = "", out: str = "") -> int:
    from rich.console import Console

    from rlax_data import evaluate
    from rlax_data.task_from_config import build_task

    task = build_task(config)
    records = task.eval_records()
    if not records:
        raise SystemExit("rlax eval: eval.num_prompts is 0, nothing to evaluate")
    model_config, params, described = load_run_params(config, task.tokenizer, weights=weights)
    sampler = EngineSampler(config, task, model_config, params, seed=config.eval.seed)
    out_dir = (
        pathlib.Path(out) if out else config.output_dir / "eval" / described.split(" (")[0].replace(" ", "_")
    )
    report = evaluate(
        records,
        sampler,
        task.verifier,
        n=config.eval.n_samples,
        ks=config.eval.pass_k,
        render=sampler.render,
        out_dir=out_dir,
    )
    console = Console()
    console.print(f"evaluated the {described} on {len(records)} prompts")
    console.print((out_dir / "eval.md").read_text() if (out_dir / "eval.md").exists() else str(report))
    console.print(f"report: {out_dir}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`rlax eval --config RUN.yaml [--weights HF_FOLDER] [--out DIR] [key=value ...]`."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--weights", default="", help="HF checkpoint folder (default: the run's newest published version)"
        )
        parser.add_argument("--out", default="", help="folder for the JSON and markdown report")

    def start(config: RunConfig, args: argparse.Namespace) -> int:
        select_platform(config.workers.platform)
        return run(config, weights=args.weights, out=args.out)

    return component_main("rlax eval", argv, start, add_arguments=add_arguments)
