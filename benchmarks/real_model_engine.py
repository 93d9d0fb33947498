"""`LLMEngine` alone on the requests of `bench_real_model.py`'s run, in a process of its own.

    python benchmarks/real_model_engine.py CONFIG.json

Same config (engine sizes from `rlax_inference.worker.engine_config_fields`),
same initial weights, the run's prompts in stream order, one request of `group_size`
samples per prompt, as the controller sends them. One warm-up request first (compilation
is not generation), then every prompt's request timed on its own. Writes
`out/engine.json`: tokens, seconds, tokens/s and this process's peak RSS.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

from child_result import write_result


def main(spec_path: str) -> None:
    from rlax_core.config import load_config
    from rlax_data.run_task import build_task
    from rlax_inference import EngineConfig, LLMEngine, SamplingParams
    from rlax_inference.worker import engine_config_fields
    from rlax_model.run_model import initial_params

    spec = json.loads(pathlib.Path(spec_path).read_text())
    config = load_config(spec["rlax_config"], spec["overrides"])
    out = pathlib.Path(spec["out"])
    task = build_task(config)
    model_config, params = initial_params(config, task.tokenizer)
    engine = LLMEngine(model_config, params, EngineConfig(**engine_config_fields(config)))
    source = task.prompt_source()
    prompts = [task.encode_prompt(source.next_prompt().record) for _ in range(int(spec["steps"]))]

    def request(prompt: list[int], seed: int) -> int:
        d = config.data
        sampling = SamplingParams(
            n=d.group_size, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k,
            max_tokens=d.max_new_tokens, seed=seed, stop_token_ids=tuple(task.stop_token_ids),
        )  # fmt: skip
        (output,) = engine.generate([prompt], sampling)
        return sum(len(c.tokens) for c in output.outputs)

    started = time.perf_counter()
    request(prompts[0], seed=10_000)
    warm_up_s = time.perf_counter() - started
    tokens, seconds = 0, 0.0
    for seed, prompt in enumerate(prompts):
        started = time.perf_counter()
        tokens += request(prompt, seed)
        seconds += time.perf_counter() - started
    result = {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "warm_up_s": warm_up_s,
    }
    write_result(out, "engine", result)


if __name__ == "__main__":
    main(sys.argv[1])
