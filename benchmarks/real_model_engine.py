"""`LLMEngine` alone on the requests of `bench_real_model.py`'s run, in a process of its own.

    python benchmarks/real_model_engine.py CONFIG.json

Same config (engine sizes from `rlax_inference.worker_process.engine_config_fields`),
same initial weights, the run's prompts in stream order, one request of `group_size`
samples per prompt, as the controller sends them. One warm-up request first (compilation
is not generation), then every prompt's request timed on its own. Writes
`out/engine.json`: tokens, seconds, tokens/s and this process's peak RSS.

With `lengths` in the spec (the run's `response_tokens` per step), the same work as the
run: each prompt's samples are generated to exactly the lengths the run's samples had,
because a decode batch's tokens/s depends on how long its rows stay in it (a group whose
one sample runs to 64 tokens decodes its tail at batch 1, as the untrained model's long
replies do not).
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any

from child_result import write_result

from rlax_inference import LLMEngine
from rlax_inference.sequence import FinishReason


class SameLengthEngine(LLMEngine):
    """`LLMEngine` whose sample i of a request listed in `targets` ends after exactly
    targets[(request_id, i)] tokens, as if it had sampled its end there: the same batch
    shapes step by step as the run's samples of those lengths (one prompt prefill shared by
    the group, copy-on-write tails, rows leaving the decode batch as they end)."""

    targets: dict[tuple[str, int], int] = {}

    def _target(self, seq: Any) -> int | None:
        return self.targets.get((seq.request.request_id, seq.sample_index))

    def _append_plain_tokens(self, seq: Any, tokens: list[int], logprobs: list[float]) -> None:
        target = self._target(seq)
        if target is None:
            super()._append_plain_tokens(seq, tokens, logprobs)
            return
        room = max(target - seq.num_generated, 0)
        super()._append_plain_tokens(seq, tokens[:room], logprobs[:room])
        if seq.num_generated >= target and seq.finish_reason is None:
            self._finish(seq, FinishReason.LENGTH)

    def _stop_reason(self, seq: Any) -> Any:
        target = self._target(seq)
        if target is not None and seq.num_generated >= target:
            return FinishReason.LENGTH
        return super()._stop_reason(seq)


def main(spec_path: str) -> None:
    from rlax_core.config import load_config
    from rlax_data.task_from_config import build_task
    from rlax_inference import EngineConfig, SamplingParams
    from rlax_inference.worker_process import engine_config_fields
    from rlax_model.model_from_config import initial_params

    spec = json.loads(pathlib.Path(spec_path).read_text())
    config = load_config(spec["rlax_config"], spec["overrides"])
    out = pathlib.Path(spec["out"])
    task = build_task(config)
    model_config, params = initial_params(config, task.tokenizer)
    engine = SameLengthEngine(model_config, params, EngineConfig(**engine_config_fields(config)))
    source = task.prompt_source()
    prompts = [task.encode_prompt(source.next_prompt().record) for _ in range(int(spec["steps"]))]

    d = config.data

    def request(prompt: list[int], seed: int) -> int:
        sampling = SamplingParams(
            n=d.group_size, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
            max_tokens=d.max_new_tokens, seed=seed, stop_token_ids=tuple(task.stop_token_ids),
        )  # fmt: skip
        (output,) = engine.generate([prompt], sampling)
        return sum(len(c.tokens) for c in output.outputs)

    def same_lengths(prompt: list[int], seed: int, lengths: list[int]) -> int:
        """One request of len(lengths) samples, as the run sent it, whose sample i ends after
        exactly lengths[i] tokens (see `SameLengthEngine`)."""
        request_id = f"same-{seed}"
        engine.targets = {(request_id, i): n for i, n in enumerate(lengths)}
        sampling = SamplingParams(
            n=len(lengths), temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
            max_tokens=max(lengths), seed=seed, ignore_eos=True,
        )  # fmt: skip
        engine.add_request(request_id, prompt, sampling)
        made = 0
        while engine.has_unfinished:
            for output in engine.step():
                made += sum(len(c.tokens) for c in output.outputs)
        return made

    lengths = spec.get("lengths")
    started = time.perf_counter()
    request(prompts[0], seed=10_000)
    if lengths:
        same_lengths(prompts[0], 10_000, [d.max_new_tokens, *[1] * (d.group_size - 1)])
    warm_up_s = time.perf_counter() - started
    per_step = []
    for seed, prompt in enumerate(prompts):
        started = time.perf_counter()
        made = same_lengths(prompt, seed, lengths[seed]) if lengths else request(prompt, seed)
        per_step.append({"tokens": made, "seconds": time.perf_counter() - started})
    skip = int(spec.get("skip_steps", 0))  # the steps the run's own figure leaves out
    tokens = sum(r["tokens"] for r in per_step[skip:])
    seconds = sum(r["seconds"] for r in per_step[skip:])
    result = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "warm_up_s": warm_up_s,
        "same_lengths_as_run": bool(lengths),
        "per_step": per_step,
    }
    write_result(out, "engine", result)


if __name__ == "__main__":
    main(sys.argv[1])
