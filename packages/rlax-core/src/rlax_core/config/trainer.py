"""`trainer:` the learner: objective, optimizer, how an update is computed, staleness k,
SFT warm start, checkpoints and the gang of trainer hosts.

`OptimizerConfig` and `UpdateOptions` are defined here, without JAX, and used as they are
by `rlax_trainer` (`LearnerConfig` extends `UpdateOptions`; `make_optimizer` reads an
`OptimizerConfig`), so every option has one definition and one default.
"""

from __future__ import annotations

import copy
import importlib.resources
import math
from typing import Any, Literal

import msgspec
import yaml

from rlax_core.config.base import AUTO, HOST_PORT, Section, check

MESH_AXES = ("data", "fsdp", "tensor")


def objective_presets() -> dict[str, dict[str, Any]]:
    """The objective presets (`objective_presets.yaml`): name -> the objective's fields.
    The one list of presets: the controller validates `trainer.preset` with it, without the
    trainer, and `rlax_trainer.objective` builds objectives from it."""
    text = importlib.resources.files("rlax_core.config").joinpath("objective_presets.yaml").read_text()
    presets: dict[str, dict[str, Any]] = yaml.safe_load(text)
    return presets


def merge_objective(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """An objective's fields `over` merged into `base` key by key (a preset and a run's
    `trainer.objective`). An advantage of another kind replaces the base's wholesale: its
    fields differ."""
    out = copy.deepcopy(base)
    for key, val in over.items():
        same_kind = (
            key != "advantage"
            or not isinstance(val, dict)
            or val.get("kind", None) in (None, out.get(key, {}).get("kind"))
        )
        if isinstance(val, dict) and isinstance(out.get(key), dict) and same_kind:
            out[key] = merge_objective(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


PRESETS = tuple(objective_presets())

Remat = Literal["none", "full", "nothing_saveable", "dots_saveable"]


class OptimizerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """AdamW with linear warm-up to `lr` over `warmup_steps` optimizer steps, then `constant`
    or `cosine` decay to `lr * min_lr_ratio` over `decay_steps` (0: to the run's last
    optimizer step, `run.steps * trainer.minibatches - warmup_steps`); gradients clipped to
    global norm `max_grad_norm` (None: no clipping). Optimizer steps, not RL steps: a batch
    makes `trainer.minibatches` of them."""

    lr: float = 1e-4
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be a finite number > 0")
        check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        check(self.decay_steps >= 0, "decay_steps", self.decay_steps, "must be >= 0 (0: the run's length)")
        check(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, name, value, "must be in [0, 1)")
        check(self.eps > 0, "eps", self.eps, "must be > 0")
        check(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            self.max_grad_norm,
            "must be > 0 (null: no clipping)",
        )


# The decoder's linear layers by name (as Hugging Face and PEFT name them), and the groups a
# LoRA `targets` entry may name instead.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGET_GROUPS = {
    "attention": ATTENTION_PROJECTIONS,
    "mlp": MLP_PROJECTIONS,
    "all-linear": ATTENTION_PROJECTIONS + MLP_PROJECTIONS,
}


class LoraConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Low-rank adapters on a frozen base (`rlax_model.lora`): each target W [in, out]
    computes x @ W + (alpha / rank) * (x @ A) @ B, A [in, rank], B [rank, out].

    - `rank`, `alpha`: the adapters' rank and scale numerator (scale = alpha / rank).
      Default rank 8: for policy-gradient RL even rank 1 matched full fine-tuning in the
      published comparisons, and rank 8 on every linear layer of SmolLM2-135M is 1.8% of
      the model's bytes per version (rank 16: 3.6%; bench_lora_sync.py).
    - `targets`: linear layers by name (`q_proj`, ..., `down_proj`) or group (`attention`,
      `mlp`, `all-linear`). Default all linear layers: for policy-gradient RL the published
      comparisons ("LoRA Without Regret") found attention-only adapters behind and
      all-layer ones on par with full fine-tuning.
    No adapter dropout (PEFT's `lora_dropout`): in RL it makes the policy the update
    differentiates differ from the one that sampled and that pi_old is computed with, so
    on-policy ratios are no longer exactly 1.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("all-linear",)

    def __post_init__(self) -> None:
        check(self.rank >= 1, "rank", self.rank, "must be an int >= 1")
        check(
            math.isfinite(self.alpha) and self.alpha > 0, "alpha", self.alpha, "must be a finite number > 0"
        )
        check(len(self.targets) > 0, "targets", self.targets, "must name at least one layer or group")
        known = set(LORA_TARGET_GROUPS) | set(LORA_TARGET_GROUPS["all-linear"])
        for target in self.targets:
            check(target in known, "targets", target, f"must be one of {sorted(known)}")

    @property
    def scale(self) -> float:
        """alpha / rank: the adapters' product is multiplied by it."""
        return self.alpha / self.rank

    def target_names(self) -> tuple[str, ...]:
        """The targeted linear layers, groups expanded, in the decoder's order."""
        named = {n for t in self.targets for n in LORA_TARGET_GROUPS.get(t, (t,))}
        return tuple(n for n in LORA_TARGET_GROUPS["all-linear"] if n in named)


class UpdateOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How one update is computed from a batch of rollouts.

    - `micro_batch`: rollouts per forward/backward pass (gradients accumulated); must divide
      the rollouts of one minibatch. 0: the whole minibatch at once.
    - `minibatches`: optimizer steps per rollout batch, so that the PPO clip acts between them.
    - `minibatch_split`: how a batch is dealt into its minibatches (seeded by the train
      state's key, so resumption is exact). `rows` (default): the rollouts are shuffled
      across the whole batch, so each minibatch holds samples of about every prompt, as
      TRL's `GRPOTrainer` does: every gradient step sees all prompts, and its direction is
      far less noisy than with whole groups. `groups`: whole prompt groups per minibatch,
      for objectives whose loss would need a group's samples together. Advantages and
      aggregation weights are formed on the whole batch before the split, so no built-in
      objective needs `groups`.
    - `remat`: rematerialisation of each layer; `nothing_saveable` is the "aligned" mode.
    - `packing`: compute only real tokens (`rlax_trainer.packing`): each minibatch's
      rollouts are packed into rows of `pack_length` tokens, a prompt group's common prefix
      once per row, and the model runs one forward/backward pass per row used, so padding
      and repeated prompts cost nothing and every batch has the same shapes (one compiled
      program). `micro_batch` then does not apply: a pass is one packed row. False: rows
      padded to the batch's length bucket, `micro_batch` rollouts per pass (a mesh of
      several devices always runs this way).
    - `pack_length`: tokens per packed row (0: twice the batch's padded length,
      `packing.auto_pack_length`); memory per pass grows with it, attention quadratically.
    - `batch_invariant`: a rollout's float32 log-probs are bitwise the same whatever it is
      padded to, batched with or packed with: every pass runs the attention over blocks of
      `rlax_model.attention.KEY_BLOCK` keys, packed rows align their segments to them, and
      the update compiles with `rlax_model.layers.ALIGNED_COMPILER_OPTIONS` (row-count
      invariant matmuls). In a run it also turns on the engines' aligned mode
      (`rlax_inference.EngineConfig.aligned`; slower decoding): a sampled token's log-prob
      is then the trainer's to the bit. Measured on a 2-layer SmolLM2-wide model, 16
      rollouts of 47-token prompts: the packed update 1.4x the time and 3.2x the temporary
      memory on 512-token rows. Off, a rollout's log-probs move with its padding, batch
      and row by up to ~3e-6.
    - `lora`: train low-rank adapters on a frozen base (`LoraConfig`; null: every weight).
      Gradients, optimizer state and checkpoints then hold only the adapters, and the KL
      reference (when the objective has one) is the base itself. Published versions are
      still the merged full weights (adapter-only versions are not built yet).
    """

    micro_batch: int = 0
    minibatches: int = 1
    minibatch_split: Literal["rows", "groups"] = "rows"
    remat: Remat = "none"
    packing: bool = True
    pack_length: int = 0
    batch_invariant: bool = False
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        check(self.micro_batch >= 0, "micro_batch", self.micro_batch, "must be >= 0 (0: whole minibatch)")
        check(
            self.minibatches >= 1, "minibatches", self.minibatches, "must be >= 1 (optimizer steps per batch)"
        )
        check(
            self.pack_length >= 0,
            "pack_length",
            self.pack_length,
            "must be >= 0 (0: twice the padded length)",
        )


class TrainerSection(UpdateOptions, Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The learner. `preset`: the objective (`objective_presets.yaml`), its fields
    overridden by `objective` (e.g. `{kl: {coef: 0.0}}`; `{credit: {assignment: per_turn,
    gamma: 0.9}}` gives each model turn of a multi-turn trajectory the advantage of its own
    discounted return, `rlax_trainer.objective.turn_credit`); `optimizer`: `OptimizerConfig`;
    the update's options: `UpdateOptions`.
    `k`: a batch holds rollouts at most k versions older than the weights it trains;
    0 is synchronous, on-policy training (generation waits for each update).
    `sft_steps`, `sft_lr`, `sft_batch`: a supervised warm start on the task's reference
    answers before RL (the `optimizer` with `lr = sft_lr`).
    `checkpoint_every`: steps between checkpoints of the train state (3x the model); every
    batch is journaled before its update, so a restarted trainer replays the batches since
    its last checkpoint and the run loses nothing either way (`rlax_trainer.journal`).
    `precompile`: at start, compile the update for every padded length the run can meet
    (from the shortest prompt to `model.max_seq_len`, by length bucket) in a background
    thread, so that no step stops to compile a new length (XLA programs have static shapes).
    `publish_dtype`: the dtype of the weights pushed to the parameter server.
    `hosts`: trainer processes (one per host) joined by `jax.distributed` into one gang;
    `coordinator`: the gang's coordinator HOST:PORT (`auto`: process 0's host, a free port);
    `mesh`: axis sizes over all devices of the gang, of `data`, `fsdp`, `tensor` (empty:
    every device on `fsdp`)."""

    preset: str = "grpo"
    objective: dict[str, Any] = msgspec.field(default_factory=dict)
    optimizer: OptimizerConfig = msgspec.field(default_factory=OptimizerConfig)
    k: int = 2
    sft_steps: int = 0
    sft_lr: float = 3e-3
    sft_batch: int = 32
    checkpoint_keep: int = 3
    checkpoint_every: int = 1
    precompile: bool = False
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    platform: str = "cpu"
    hosts: int = 1
    coordinator: str = AUTO
    mesh: dict[str, int] = {}

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.preset in PRESETS, "preset", self.preset, f"must be one of {', '.join(PRESETS)}")
        check(
            math.isfinite(self.sft_lr) and self.sft_lr > 0,
            "sft_lr",
            self.sft_lr,
            "must be a finite number > 0",
        )
        check(self.k >= 0, "k", self.k, "must be >= 0 (0: synchronous, on-policy)")
        check(self.sft_steps >= 0, "sft_steps", self.sft_steps, "must be >= 0")
        check(self.sft_batch >= 1, "sft_batch", self.sft_batch, "must be >= 1")
        check(self.checkpoint_keep >= 2, "checkpoint_keep", self.checkpoint_keep, "must be >= 2")
        check(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "must be >= 1")
        check(self.hosts >= 1, "hosts", self.hosts, "must be >= 1 (trainer processes in the gang)")
        check(
            self.coordinator == AUTO or bool(HOST_PORT.match(self.coordinator)),
            "coordinator",
            self.coordinator,
            "must be 'auto' or HOST:PORT",
        )
        for axis, size in self.mesh.items():
            check(axis in MESH_AXES, f"mesh.{axis}", size, f"axes are {', '.join(MESH_AXES)}")
            check(size >= 1, f"mesh.{axis}", size, "must be >= 1")

    def update_options(self) -> UpdateOptions:
        """The options of `UpdateOptions` this section sets (the learner's, by name)."""
        names = msgspec.structs.fields(UpdateOptions)
        return UpdateOptions(**{f.name: getattr(self, f.name) for f in names})
