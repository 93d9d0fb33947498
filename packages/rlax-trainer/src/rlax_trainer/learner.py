"""The learner: the train state and the compiled update for one model and one LearnerConfig.

The update itself (`rlax_trainer.learner_update`) is one jitted program from a padded
rollout batch; the learner lays a batch out for it (packed, or trimmed to its length
bucket), compiles it per batch signature (`rlax_trainer.learner_compile`), and holds the
float32 master weights, the optimizer state and the KL reference between updates.
"""

from __future__ import annotations

import concurrent.futures
import functools
from contextlib import AbstractContextManager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import rlax_model
import rlax_model.lora
from rlax_trainer.buffer import RolloutBatch, one_turn_layout
from rlax_trainer.config import LearnerConfig, learning_rate_schedule, make_optimizer
from rlax_trainer.learner_compile import CompiledUpdates
from rlax_trainer.learner_passes import UpdateSpec, compute_dtype, sampler_logprobs
from rlax_trainer.learner_update import (
    FrozenParams,
    TrainState,
    batch_update,
    batch_update_jit,
    batch_update_jit_aligned,
    minibatch_order,
)
from rlax_trainer.memory import peak_memory_metrics, release_free_memory
from rlax_trainer.packing import best_layout, candidate_lengths
from rlax_trainer.padding import trim_to_bucket
from rlax_trainer.sharding import batch_sharding, param_sharding, put_global, replicated, to_host

__all__ = ["Learner", "TrainState", "batch_arrays", "minibatch_order", "sampler_logprobs"]


_merge = jax.jit(rlax_model.lora.merge_adapters, static_argnums=2)


def batch_arrays(batch: RolloutBatch) -> dict[str, np.ndarray]:
    """The arrays of a RolloutBatch that the jitted update reads."""
    return {
        "tokens": batch.tokens.astype(np.int32),
        "valid": batch.valid.astype(bool),
        "mask": batch.mask.astype(np.float32),
        "worker_logprobs": batch.worker_logprobs.astype(np.float32),
        "rewards": batch.rewards.astype(np.float32),
        "versions": batch.versions.astype(np.int32),
        "token_rewards": batch.token_rewards.astype(np.float32),
        "turn_ends": batch.turn_ends.astype(np.float32),
    }


def _with_defaults(batch: RolloutBatch | dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The update's arrays of a batch; a dict may leave out `versions` (unknown: counted as
    stale) and the per-turn arrays (each row one turn, as `collate` lays out a rollout
    without per-turn rewards), so that every batch of a length runs one compiled program."""
    if isinstance(batch, RolloutBatch):
        return batch_arrays(batch)
    arrays = dict(batch)
    arrays.setdefault("versions", np.full((arrays["tokens"].shape[0],), -1, np.int32))
    if ("token_rewards" in arrays) != ("turn_ends" in arrays):
        raise ValueError("batch fields token_rewards and turn_ends come together (or neither: one turn)")
    if "token_rewards" not in arrays:
        arrays["token_rewards"], arrays["turn_ends"] = one_turn_layout(arrays["rewards"], arrays["mask"])
    return arrays


class Learner:
    """Holds the train state and the compiled update for one model and one LearnerConfig.

    model_config: `rlax_model.ModelConfig`; params: its parameter tree (any float dtype:
    copied to float32 masters). `reference_params` (frozen, for the KL term) defaults to
    a copy of `params` when the objective has a KL coefficient. `mesh`: shard params,
    optimizer state and batches over it (None: one device).
    """

    def __init__(
        self,
        model_config: rlax_model.ModelConfig,
        config: LearnerConfig,
        params: Any,
        *,
        reference_params: Any | None = None,
        mesh: Mesh | None = None,
        seed: int = 0,
    ) -> None:
        # The same dtype policy as the inference engine's (a float32 copy for bfloat16 on a CPU).
        self.model_config = rlax_model.dtype_policy(model_config)
        self.config = config
        self.mesh = mesh
        self.optimizer = make_optimizer(config.optimizer)
        self.lr_schedule = learning_rate_schedule(config.optimizer)
        obj = config.objective if config.mode == "rl" else None
        self.uses_value = obj is not None and obj.value is not None
        self.uses_reference = obj is not None and obj.kl.coef > 0
        # Copies: the update donates its state, which must never alias the caller's arrays.
        self.lora = config.lora
        base = None
        if self.lora is None:
            master = {"policy": jax.tree.map(lambda x: jnp.array(x, jnp.float32, copy=True), params)}
        else:
            # The frozen base in the compute dtype (the passes would cast it to that anyway):
            # no float32 master, gradient or optimizer state of it. Fresh adapters (B = 0)
            # leave the policy at the base to the bit.
            base = jax.tree.map(lambda x: jnp.array(x, compute_dtype(config), copy=True), params)
            key = jax.random.fold_in(jax.random.key(seed), 1)  # apart from the state's key
            master = {"lora": rlax_model.lora.init_adapters(self.model_config, self.lora, key)}
        if self.uses_value:
            master["value"] = {
                "w": jnp.zeros((model_config.hidden_size,), jnp.float32),
                "b": jnp.zeros((), jnp.float32),
            }
        ref = None
        if self.uses_reference and base is not None and reference_params is None:
            ref = base  # the policy with its adapters off: no second copy of the model
        elif self.uses_reference:
            src = params if reference_params is None else reference_params
            ref = jax.tree.map(lambda x: jnp.array(x, compute_dtype(config), copy=True), src)
        rng = jax.random.key_data(jax.random.key(seed))
        if mesh is None:
            self._param_sh = self._ref_sh = self._base_sh = self._opt_sh = self._state_sh = None
            opt_state = jax.jit(self.optimizer.init)(master)
            self.state = TrainState(master, opt_state, jnp.zeros((), jnp.int32), rng)
            self.reference_params = ref
            self.base = base
        else:
            rep = replicated(mesh)
            self._param_sh = param_sharding(master, mesh)
            abstract_opt = jax.eval_shape(self.optimizer.init, master)
            self._opt_sh = optax.tree_map_params(
                self.optimizer,
                lambda _, s: s,
                abstract_opt,
                self._param_sh,
                transform_non_params=lambda _: rep,
            )
            master = put_global(master, self._param_sh)
            opt_state = jax.jit(self.optimizer.init, out_shardings=self._opt_sh)(master)
            self._state_sh = TrainState(self._param_sh, self._opt_sh, rep, rep)
            self.state = TrainState(
                master, opt_state, put_global(np.zeros((), np.int32), rep), put_global(np.asarray(rng), rep)
            )
            self._base_sh = None if base is None else param_sharding(base, mesh)
            self.base = None if base is None else put_global(base, self._base_sh)
            if ref is not None and ref is base:  # placed once, read as both
                self._ref_sh, self.reference_params = self._base_sh, self.base
            else:
                self._ref_sh = None if ref is None else param_sharding(ref, mesh)
                self.reference_params = None if ref is None else put_global(ref, self._ref_sh)
        self._update_fn = self._compile_update()
        # Compiled ahead of the call, so that compile time is measured apart from the step.
        self._programs = CompiledUpdates()
        self.last_seq_len: int | None = None  # padded length the last update ran at
        self.last_compile_seconds = 0.0  # what the last update spent compiling (0: reused)

    def _compile_update(self) -> Any:  # a jitted update, or one bound to its spec (`_lower` tells)
        spec = UpdateSpec(self.model_config, self.config)
        aligned = self.config.batch_invariant
        if self.mesh is None:
            return functools.partial(batch_update_jit_aligned if aligned else batch_update_jit, spec)
        rep = replicated(self.mesh)
        return jax.jit(
            functools.partial(batch_update, spec),
            in_shardings=(
                self._state_sh,
                FrozenParams(self._ref_sh, self._base_sh),
                batch_sharding(self.mesh),
            ),
            out_shardings=(self._state_sh, rep),
            donate_argnums=(0,),
            compiler_options=rlax_model.layers.ALIGNED_COMPILER_OPTIONS if aligned else None,
        )

    # ------------------------------------------------------------------ public
    def update(self, batch: RolloutBatch | dict[str, np.ndarray]) -> dict[str, float]:
        """One update from a batch of exactly `global_batch` rollouts; returns host metrics."""
        arrays = _with_defaults(batch)
        b = arrays["tokens"].shape[0]
        if b != self.config.global_batch:
            raise ValueError(f"batch has {b} rollouts, expected global_batch={self.config.global_batch}")
        s = arrays["tokens"].shape[1]
        for name, want in (
            ("valid", (b, s)),
            ("mask", (b, s - 1)),
            ("worker_logprobs", (b, s - 1)),
            ("rewards", (b,)),
            ("versions", (b,)),
            ("token_rewards", (b, s - 1)),
            ("turn_ends", (b, s - 1)),
        ):
            if arrays[name].shape != want:
                raise ValueError(f"batch field {name} has shape {arrays[name].shape}, expected {want}")
        arrays, work = self._lay_out(arrays)
        self.last_seq_len = int(arrays["tokens"].shape[1])
        if self.mesh is not None:
            arrays = put_global(arrays, self._input_shardings(arrays))
        executable, self.last_compile_seconds = self._programs.get(arrays, self._lower)
        if self.last_compile_seconds:
            # The compiler's freed memory, before the update maps its temporaries: on top of
            # ~220 MiB of it the first update of SmolLM2 (64 new tokens) set the trainer's
            # peak (3,689 MiB; 3,503 with this trim; later updates 3.15 GB).
            release_free_memory()
        with self.busy() as waited:
            self.last_compile_seconds += waited
            before = jax.tree.leaves(self.state.params)
            self.state, metrics = executable(self.state, self.frozen, arrays)
            out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        # The update donates the state: a master buffer something else still referenced (a
        # zero-copy host view, e.g. of a push in flight) cannot be donated, and XLA allocates
        # a copy of it instead: that much more memory for the step.
        out["trainer_undonated_mb"] = sum(x.nbytes for x in before if not x.is_deleted()) / 2**20
        out["trainer_seq_len"] = float(self.last_seq_len)  # padded length it ran at
        out.update(work)
        out["trainer_compile_seconds"] = self.last_compile_seconds
        out.update(peak_memory_metrics())
        return out

    def _lay_out(
        self, arrays: dict[str, np.ndarray], pack_lengths: list[int] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The update's input arrays for a batch (packed, or trimmed to its length bucket) and
        what its passes compute: `train_token_efficiency` (real tokens / positions computed)
        and `train_compute_ratio` (positions computed / the rollouts' tokens: below 1 when
        shared prefixes are computed once)."""
        cfg = self.config
        rollout_tokens = int(np.asarray(arrays["valid"]).sum())
        if self._packs():
            tokens = np.asarray(arrays["tokens"])
            b, s = tokens.shape
            order = self._row_order(b)
            lengths = pack_lengths or self.pack_lengths(s)
            align = rlax_model.attention.KEY_BLOCK if cfg.batch_invariant else 1
            layout = best_layout(
                tokens, np.asarray(arrays["valid"]), order, cfg.minibatches, cfg.group_size, lengths, align
            )
            arrays = {**arrays, **layout.arrays(), "order": order.astype(np.int32)}
            computed, real = layout.computed_tokens, int((layout.segment > 0).sum())
        else:
            if cfg.trim_padding:
                arrays = trim_to_bucket(arrays)
            computed, real = int(np.prod(arrays["tokens"].shape)), rollout_tokens
        work = {
            "train_token_efficiency": real / max(computed, 1),
            "train_compute_ratio": computed / max(rollout_tokens, 1),
            "train_computed_tokens": float(computed),
        }
        return arrays, work

    def pack_lengths(self, seq_len: int) -> list[int]:
        """The packed row lengths batches padded to `seq_len` may run at (one program each)."""
        return [self.config.pack_length] if self.config.pack_length else candidate_lengths(seq_len)

    def _packs(self) -> bool:
        """Whether updates run packed: `packing` on one device (a mesh runs rows padded)."""
        return self.config.packing and self.mesh is None

    def _row_order(self, rows: int) -> np.ndarray:
        """The row order the update deals minibatches in (`minibatch_order` with the key the
        jitted update splits off the state's), computed here so that the host can pack."""
        key = jax.random.wrap_key_data(jnp.asarray(np.asarray(jax.device_get(self.state.rng))))
        return np.asarray(minibatch_order(jax.random.split(key)[1], rows, self.config))

    def _input_shardings(self, arrays: dict[str, Any]) -> dict[str, Any]:
        """Per-row arrays sharded over the batch axis; the packing's arrays replicated."""
        assert self.mesh is not None
        rep = replicated(self.mesh)
        return {k: rep if k.startswith("pk_") or k == "order" else batch_sharding(self.mesh) for k in arrays}

    @property
    def frozen(self) -> FrozenParams:
        """What the update reads and does not train: the KL reference and the LoRA base."""
        return FrozenParams(self.reference_params, self.base)

    def _lower(self, arrays: dict[str, Any], state: Any = None, frozen: Any = None) -> Any:
        state = self.state if state is None else state
        frozen = self.frozen if frozen is None else frozen
        fn = self._update_fn
        if isinstance(fn, functools.partial) and fn.func in (batch_update_jit, batch_update_jit_aligned):
            return fn.func.lower(fn.args[0], state, frozen, arrays)
        return fn.lower(state, frozen, arrays)

    def precompile(self, seq_lens: list[int]) -> list[concurrent.futures.Future[Any]]:
        """Compile the update for batches padded to each of `seq_lens` in a background
        thread (one program at a time, never while an update or a `busy()` step runs), so
        that the steps that first meet those lengths do not compile; a step that meets a
        length not compiled yet compiles it itself. Call it while the trainer would
        otherwise wait (before the first batch). Returns the compilations it started."""

        def abstract(x: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding or getattr(x, "sharding", None))

        b = self.config.global_batch
        state = jax.tree.map(abstract, self.state)  # the live state is donated by each update
        frozen = jax.tree.map(abstract, self.frozen)
        started = []
        # Packed batches keep the length they were padded to (the longest) and run at one of
        # a few row lengths; padded ones at their length bucket.
        s_max = max(seq_lens)
        shapes: list[tuple[int, list[int] | None, int]] = (
            [(s_max, [n], r) for n in self.pack_lengths(s_max) for r in (1, 2)] if self._packs() else []
        )
        shapes = shapes or [(s, None, 0) for s in sorted(set(seq_lens))]
        for s, pack_length, packed_rows in shapes:
            # The arrays `batch_arrays` makes of a batch padded to s (their dtypes from it),
            # laid out as the update will (packed into one row or several, or at full length).
            rows, cols = np.zeros((b, s)), np.zeros((b, s - 1))
            # Rollouts of 2 tokens sharing 1 pack into one row; full-row ones into several.
            real = 2 if packed_rows == 1 else min(s, pack_length[0] if pack_length else s)
            valid = np.repeat(np.arange(s)[None, :] < real, b, 0)
            padded = RolloutBatch(rows, valid, cols, cols, np.zeros(b), np.zeros(b), cols, cols)
            laid_out, _ = self._lay_out(batch_arrays(padded), pack_length)
            shardings = None if self.mesh is None else self._input_shardings(laid_out)
            arrays = {
                k: abstract(v, None if shardings is None else shardings[k]) for k, v in laid_out.items()
            }
            future = self._programs.start(arrays, functools.partial(self._lower, arrays, state, frozen))
            if future is not None:
                started.append(future)
        return started

    def busy(self) -> AbstractContextManager[float]:
        """`with learner.busy() as waited:` around work that allocates a lot (an update; a
        trainer's whole step with its checkpoint and push): `precompile`'s thread does not
        compile meanwhile. `waited`: seconds spent waiting for a compilation in progress to
        finish (0.0 when none was), which callers count as compile time. Reentrant."""
        return self._programs.busy()

    def stop_precompile(self) -> None:
        """Drop the lengths `precompile` has not started (the one compiling finishes)."""
        self._programs.stop()

    def compiled_memory(self, batch: RolloutBatch | dict[str, np.ndarray]) -> dict[str, int]:
        """XLA's memory analysis of the update compiled for this batch's shapes (nothing runs).

        Returns {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes"}: temp is
        the scratch the program needs beyond its inputs and outputs (activations, logits).
        """
        arrays = _with_defaults(batch)
        m = self._lower(self._lay_out(arrays)[0]).compile().memory_analysis()
        return {
            "argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes),
            "alias_bytes": int(m.alias_size_in_bytes),
        }

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state.step))

    def policy_params(self) -> Any:
        """The float32 weights of the policy (global arrays): the masters, or under `lora`
        the base with the adapters merged in (`rlax_model.lora.merge_adapters`)."""
        if self.lora is None:
            return self.state.params["policy"]
        base = jax.tree.map(lambda x: x.astype(jnp.float32), self.base)
        return _merge(base, self.state.params["lora"], self.lora.scale)

    def host_params(self) -> Any:
        """The params as numpy on this process (gathered across processes): the trainable
        ones, with "policy" the merged weights under `lora` (its "lora" adapters beside)."""
        if self.lora is None:
            return to_host(self.state.params)
        return to_host({**self.state.params, "policy": self.policy_params()})

    def host_base(self) -> Any:
        """Under `lora`: the frozen base, in its held dtype, as numpy on this process
        (gathered across processes)."""
        if self.base is None:
            raise ValueError("host_base: this learner trains every weight (trainer.lora is not set)")
        return to_host(self.base)

    def host_adapters(self) -> Any:
        """Under `lora`: the adapters (float32) as numpy on this process (gathered)."""
        if self.lora is None:
            raise ValueError("host_adapters: this learner trains every weight (trainer.lora is not set)")
        return to_host(self.state.params["lora"])

    def load_state(self, state: TrainState) -> None:
        """Replace the train state (e.g. restored from a checkpoint); re-shards it onto the mesh."""
        if self.mesh is not None:
            state = put_global(state, self._state_sh)
        self.state = state
