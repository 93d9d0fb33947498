"""The trainer process (`rlax trainer`, `rlax-trainer`): the loop around `rlax_trainer.Learner`.

    restore the newest checkpoint and replay the journaled batches after it, or: init (or
    load) the model, SFT warm start, save step 0
    make sure the parameter server holds the version of that step
    loop: ask the controller for the batch of step s  ->  journal it  ->  update  ->  log
          the trained ids  ->  every `trainer.checkpoint_every` steps, checkpoint step s+1
          (and wait for it)  ->  push version s+1

The journal entry is the commit point of a step (`rlax_trainer.journal`): a crash before
it retrains the same step (the controller resends the same batch, or rebuilds it from the
snapshot of step s); a crash after it restores the newest checkpoint, replays every
journaled batch since it through the same deterministic update -- so it reaches the very
weights it had pushed -- and re-pushes them if the parameter server lacks them. The
controller learns that step s is done from the next request (step s+1).

Several hosts (`trainer.hosts` > 1, `--process-id I`): the processes join one gang
(`rlax_trainer.gang`) before any JAX computation and run this same loop over one mesh;
process 0 alone talks to the controller and the parameter server and writes
trainer_metrics.jsonl, and broadcasts every reply and decision to the others, so that all
of them run the same collectives (updates, checkpoints, gathers of the weights) in order.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import msgspec

from rlax_core.addresses import resolver
from rlax_core.cli import component_main, exit_on_sigterm, select_platform
from rlax_core.config import ConfigError, OptimizerConfig, RunConfig, rejected_by
from rlax_core.fsutil import append_line
from rlax_data.task_from_config import build_task
from rlax_model import dtype_policy
from rlax_model.model_from_config import (
    checked_model_config,
    initial_params,
    require_platform,
    use_compile_cache,
)
from rlax_paramserver import ParamClient
from rlax_protocol.control_messages import (
    BatchRequest,
    NoBatchYet,
    RunComplete,
    TrainBatch,
    decode_control,
    encode_control,
)
from rlax_protocol.errors import ProtocolTimeoutError
from rlax_protocol.lora_versions import tree_sha256
from rlax_protocol.request_links import ControlClient
from rlax_trainer.buffer import collate
from rlax_trainer.config import LearnerConfig
from rlax_trainer.gang import Gang, gang_mesh, join_gang, mesh_axes
from rlax_trainer.journal import BatchJournal, JournalDamagedError
from rlax_trainer.learner import Learner
from rlax_trainer.memory import peak_memory_metrics, release_free_memory
from rlax_trainer.padding import bucketed_length
from rlax_trainer.sft_warm_start import sft_warm_start
from rlax_trainer.weight_push import WeightPusher

__all__ = ["TrainerLoop", "check", "learner_config", "main", "run"]

log = logging.getLogger("rlax.trainer")

# Below this many bytes of float32 master weights the trainer does not `malloc_trim` after an
# update, push or checkpoint: what it would return is small, and the trim costs ~10 ms.
TRIM_MIN_PARAM_BYTES = 64 * 1024 * 1024


def learner_config(config: RunConfig, *, mode: str) -> Any:
    """`rlax_trainer.LearnerConfig` for RL (the preset plus overrides) or the SFT warm start:
    the trainer section's own `UpdateOptions` and `OptimizerConfig` as they are, with what the
    update takes from the other sections (batch shape, sampler, dtype, the run's length)."""
    from rlax_model import resolve_dtypes
    from rlax_trainer import LearnerConfig, learner_config_from_dict

    t = config.trainer
    # The forward pass's dtype after rlax_model's dtype policy (float32 for bfloat16 on a CPU),
    # the same rule the workers apply, so trainer and engine compute alike.
    param_dtype = resolve_dtypes(config.model.param_dtype)[0]
    if mode == "sft":
        optimizer = msgspec.structs.replace(
            OptimizerConfig(), lr=t.sft_lr, max_grad_norm=t.optimizer.max_grad_norm
        )
        return rejected_by(
            "the trainer (trainer.sft_*)",
            lambda: LearnerConfig(
                mode="sft",
                group_size=1,
                global_batch=t.sft_batch,
                param_dtype=param_dtype,
                optimizer=optimizer,
            ),
        )
    optimizer = t.optimizer
    if optimizer.decay_steps == 0:
        # Optimizer steps: `minibatches` per RL step, so the decay ends with the run.
        decay = max(1, config.run.steps * t.minibatches - optimizer.warmup_steps)
        optimizer = msgspec.structs.replace(optimizer, decay_steps=decay)
    sampled = config.data.temperature > 0
    data: dict[str, Any] = {
        **msgspec.structs.asdict(t.update_options()),
        "mode": "rl",
        "objective": {"base": t.preset, **t.objective},
        "group_size": config.data.group_size,
        "global_batch": config.batch_size,
        "param_dtype": param_dtype,
        "temperature": config.data.temperature if sampled else 1.0,
        # The workers' logprobs are on the top-p/top-k truncated distribution: the
        # trainer recomputes pi_old on the same support (greedy ignores the filters).
        "top_p": config.data.top_p if sampled else 1.0,
        "top_k": config.data.top_k if sampled else 0,
        "optimizer": msgspec.to_builtins(optimizer),
    }
    try:
        return learner_config_from_dict(data)
    except ValueError as error:
        raise ValueError(f"trainer config ({mode}): {error}") from None


def reproducibility_caveat(rl_config: LearnerConfig) -> str:
    """Why this objective makes a run's trajectory depend on timing ('' when it does not).

    An off-policy correction weighs each token by the workers' log-probs. Without
    `batch_invariant` the engine's log-probs move in their last bits with the rows that
    share its batch, and which rows do depends on when requests arrive (lag > 0,
    evaluations, kills): measured on the demo at lag 2 with TIS, two runs of one seed
    differed in the loss from step 1 and in the sampled tokens from step 22; with
    `trainer.batch_invariant: true` they were identical."""
    assert rl_config.objective is not None
    kind = rl_config.objective.importance.correction.kind
    if kind == "none" or rl_config.batch_invariant:
        return ""
    return (
        f"trainer.objective.importance.correction.kind={kind!r} reads the workers' log-probs, which "
        "without trainer.batch_invariant move in their last bits with the requests that share an "
        "engine batch: a run, killed or not, may not repeat its trajectory exactly. Set "
        "trainer.batch_invariant: true for bitwise-repeatable runs (slower decoding)."
    )


class TrainerLoop:
    """State and steps of the trainer process (constructed once per process life)."""

    def __init__(self, config: RunConfig, gang: Gang | None = None) -> None:
        # Imported here: orbax, on import, puts a handler on the root logger, and the
        # component's logging setup (`rlax_core.cli.setup_logging`) would then do nothing.
        from rlax_trainer.checkpoint import CheckpointManager

        self.config = config
        self.gang = gang or Gang()
        self.mesh = gang_mesh(config)
        self.output = config.output_dir
        self.task = build_task(config)
        self.pad_id = int(self.task.tokenizer.pad_id)
        self.seq_len = config.model.max_seq_len
        model_config, init = initial_params(config, self.task.tokenizer)
        self.model_config = dtype_policy(model_config)  # the workers apply the same policy
        self.rl_config = learner_config(config, mode="rl")
        caveat = reproducibility_caveat(self.rl_config)
        if caveat:
            log.warning("%s", caveat)
        self.checkpoints = CheckpointManager(
            self.output / "checkpoints" / "rl", max_to_keep=config.trainer.checkpoint_keep, asynchronous=True
        )
        # Only the leader talks to the parameter server (and writes the metrics).
        self.pusher = WeightPusher(
            self.gang,
            ParamClient(
                config.paramserver.address,
                timeout_s=config.controller.request_timeout_s,
                resolve=resolver(config.addresses.book, "paramserver", config.paramserver.address),
            )
            if self.gang.leader
            else None,
            address=config.paramserver.address,
            timeout_s=config.controller.request_timeout_s,
            dtype=config.trainer.publish_dtype,
        )
        self.metrics_path = self.output / "trainer_metrics.jsonl"
        self.journal = BatchJournal(self.output / "checkpoints" / "journal")
        template = Learner(self.model_config, self.rl_config, init, mesh=self.mesh, seed=config.run.seed)
        restored = self.checkpoints.restore(template.state)
        reference_store = CheckpointManager(
            self.output / "checkpoints" / "reference", max_to_keep=1, asynchronous=False
        )
        uses_reference = template.uses_reference
        self.last_metrics: dict[str, float] = {}  # the figures of the last committed step
        self.last_rollout_ids: list[str] = []
        if restored is None:
            # The template's float32 params and optimizer state (3x the model) would otherwise
            # still be alive while the learner below allocates its own: free them first.
            del template
            params = self.sft_warm_start(init) if config.trainer.sft_steps else init
            self.learner = Learner(
                self.model_config, self.rl_config, params, mesh=self.mesh, seed=config.run.seed
            )
            if self.learner.uses_reference and self.learner.lora is None:  # under lora: the base
                reference_store.save(self.learner.state, version=0)
                reference_store.wait()
            self.base_sha256 = self._base_digest()
            self.checkpoints.save(
                self.learner.state, version=0, extra={"rollout_ids": [], **self._base_record()}
            )
            self.checkpoints.wait()
            self.journal.clear()  # nothing before step 0 is replayed
            log.info("initial checkpoint saved (step 0)")
        else:
            state, info = restored
            reference = None
            # Under lora the reference is the base, rebuilt from `init` as at the start.
            if uses_reference and template.lora is None:
                found = reference_store.restore(template.state)
                if found is None:
                    raise RuntimeError(f"{reference_store.directory}: the KL reference weights are missing")
                reference = found[0].params["policy"]
                del found
            del template
            self.learner = Learner(
                self.model_config,
                self.rl_config,
                init,
                reference_params=reference,
                mesh=self.mesh,
                seed=config.run.seed,
            )
            self.learner.load_state(state)
            self.base_sha256 = self._base_digest()
            recorded = info.extra.get("lora_base_sha256")
            if recorded != self.base_sha256:
                raise RuntimeError(
                    f"{self.checkpoints.directory}: checkpoint step {info.step} holds adapters trained on a "
                    f"base with SHA-256 {str(recorded)[:16]}..., this run's base is "
                    f"{str(self.base_sha256)[:16]}... (model.* or the base's file changed): "
                    "resume with the base it was trained on, or start a new run (--overwrite)"
                )
            self.last_metrics = dict(info.extra.get("metrics", {}))
            self.last_rollout_ids = list(info.extra.get("rollout_ids", []))
            log.info("resumed from checkpoint step %d (version %d)", info.step, info.version)
        reference_store.close()
        jax.clear_caches()
        self.step = self.learner.step
        self.param_bytes = sum(x.nbytes for x in jax.tree.leaves(self.learner.state.params))
        if restored is not None:
            self._replay(restored[1].step)

    def _base_digest(self) -> str | None:
        """Under `trainer.lora`, the SHA-256 of the frozen base as the trainer holds it (a
        gather: every process of the gang computes it); None for a full-parameter run."""
        if self.learner.lora is None:
            return None
        return tree_sha256(self.learner.host_base())

    def _base_record(self) -> dict[str, Any]:
        """What a checkpoint records of the base: a LoRA checkpoint holds adapters only, and
        resuming them on another base would train another model without a word."""
        return {} if self.base_sha256 is None else {"lora_base_sha256": self.base_sha256}

    def precompile(self) -> None:
        """Start compiling the update for each padded length a batch can have: the length
        buckets from the task's shortest prompt + 1 up to model.max_seq_len."""
        try:
            shortest = min(len(self.task.encode_prompt(r)) for r in self.task.train_records()[:64])
        except Exception as error:  # the prompts are not readable here: compile on first use
            log.warning("precompile skipped: cannot read the task's prompts (%s)", error)
            return
        top = self.seq_len
        lengths = sorted({min(bucketed_length(n), top) for n in range(min(shortest + 1, top), top + 1)})
        log.info("compiling the update for padded lengths %s in the background", lengths)
        self.learner.precompile(lengths)

    def _replay(self, checkpoint_step: int) -> None:
        """Train the journaled batches after the restored checkpoint again, in order (the
        leader reads them; every process of the gang runs the same updates)."""
        replayed = 0
        while True:
            payload = None
            if self.gang.leader:
                try:
                    payload = self.journal.read(self.step) or b""
                except JournalDamagedError as error:
                    # Stop here: the controller rebuilds this step's batch from its snapshot.
                    log.error("%s; replay stops at step %d", error, self.step)
                    self.journal.prune_from(self.step)
                    payload = b""
            payload = self.gang.broadcast_bytes(payload)
            if not payload:
                break
            batch = decode_control(payload)
            if not isinstance(batch, TrainBatch) or batch.step != self.step:
                raise RuntimeError(
                    f"{self.journal.directory}: the entry of step {self.step} holds "
                    f"{type(batch).__name__} of step {getattr(batch, 'step', '?')}"
                )
            self.train(batch, replay=True)
            replayed += 1
        if replayed:
            log.info(
                "replayed %d journaled step(s) after checkpoint step %d: now at step %d",
                replayed,
                checkpoint_step,
                self.step,
            )

    # ------------------------------------------------------------------ SFT
    def sft_warm_start(self, params: Any) -> Any:
        """Cross-entropy on the task's reference answers (deterministic order from data.seed)."""
        cfg = self.config
        return sft_warm_start(
            self.task,
            self.model_config,
            learner_config(cfg, mode="sft"),
            params,
            steps=cfg.trainer.sft_steps,
            data_seed=cfg.data.seed,
            seed=cfg.run.seed,
            mesh=self.mesh,
            pad_id=self.pad_id,
            seq_len=self.seq_len,
            log_metrics=self._log_metrics,
        )

    def _log_metrics(self, record: dict[str, Any]) -> None:
        if self.gang.leader:
            append_line(self.metrics_path, json.dumps(record))

    # ------------------------------------------------------------------ publishing
    def publish(self) -> None:
        """Push the weights of `self.step` unless the parameter server already has them,
        retrying while the parameter server restarts (up to controller.request_timeout_s).
        Every process of the gang calls it (the gather of the weights is a collective)."""
        lora = self.learner.lora
        if lora is None:
            self.pusher.publish(self.step, lambda: self.learner.host_params()["policy"])
            return
        # Adapter-only versions on a base pushed once (`rlax_protocol.lora_versions`).
        self.pusher.publish_adapters(
            self.step, self.learner.host_base, self.learner.host_adapters, lora.scale
        )

    def _trim_memory(self) -> None:
        """Hand freed memory back to the OS when the model is big enough for it to matter
        (`TRIM_MIN_PARAM_BYTES`): `malloc_trim` walks the whole heap, and on the demo's tiny
        model it was half of the trainer's busy time (~35 ms a step) for nothing."""
        if self.param_bytes >= TRIM_MIN_PARAM_BYTES:
            release_free_memory()

    # ------------------------------------------------------------------ training
    def train(self, batch: TrainBatch, *, replay: bool = False, waited_s: float = 0.0) -> dict[str, float]:
        """One step: journal the batch (unless `replay`: it comes from the journal), update,
        checkpoint when the step is a multiple of `trainer.checkpoint_every`, and push the
        new version (not while replaying: it was pushed in the first life). A background
        precompilation (`trainer.precompile`) waits while a step runs. `waited_s`: how long
        the trainer waited for this batch since its previous step ended (rollouts and scoring,
        as the trainer sees them), reported as `trainer_wait_seconds`."""
        with self.learner.busy() as waited:  # a compilation finishing counts as compile time
            return self._train(batch, replay=replay, compile_wait_s=waited, waited_s=waited_s)

    def _train(
        self, batch: TrainBatch, *, replay: bool, compile_wait_s: float, waited_s: float
    ) -> dict[str, float]:
        if batch.step != self.step:
            raise RuntimeError(
                f"controller sent the batch of step {batch.step}, the trainer is at step {self.step}"
            )
        parts = {"trainer_wait_seconds": waited_s}  # the step's wall time by part
        if not replay:
            if self.config.chaos.max_delay_s > 0:  # a test hook; unseeded: timing is the point
                time.sleep(random.uniform(0.0, self.config.chaos.max_delay_s))
            if self.gang.leader:
                started = time.monotonic()
                self.journal.write(batch.step, encode_control(batch))
                parts["trainer_journal_seconds"] = time.monotonic() - started
        g = batch.group_size
        groups = [batch.rollouts[i : i + g] for i in range(0, len(batch.rollouts), g)]
        arrays = collate(groups, pad_id=self.pad_id, seq_len=self.seq_len)
        # What the background compilations freed since the last trim, before the update maps
        # its temporaries (SmolLM2, 64 new tokens: 230 MiB returned before step 1, whose
        # update sets the trainer's peak). A compilation in the update itself: `Learner.update`.
        self._trim_memory()
        started = time.monotonic()
        metrics = self.learner.update(arrays)
        metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
        # Compiling a new padded length is reported on its own (trainer_compile_seconds).
        metrics["train_seconds"] = time.monotonic() - started - metrics.get("trainer_compile_seconds", 0.0)
        if compile_wait_s:
            metrics["trainer_compile_seconds"] = metrics.get("trainer_compile_seconds", 0.0) + compile_wait_s
        self._trim_memory()  # the update's temporaries, before the checkpoint allocates
        self.step = self.learner.step
        self.last_rollout_ids = list(batch.rollout_ids)
        # The checkpoint (when due) before the push: the two together would hold the weights'
        # host copy for the push on top of the checkpoint's buffers (+0.5 GB for SmolLM2).
        started = time.monotonic()
        if self.step % self.config.trainer.checkpoint_every == 0:
            self.last_metrics = {**metrics, **parts}  # saved with the state (the push is not yet)
            self.checkpoint()
        parts["trainer_checkpoint_seconds"] = time.monotonic() - started
        if not replay:
            started = time.monotonic()
            self.publish()
            self._trim_memory()  # the weights' host copy for the push, before the next update
            parts["trainer_push_seconds"] = time.monotonic() - started
        metrics.update(parts)
        # The peak as of the step's end: its checkpoint and push included, not only the update.
        metrics.update(peak_memory_metrics())
        # The step's figures travel with the state: a trainer restarted before it could
        # report them to the controller reports them from here (or from the replay).
        self.last_metrics = metrics
        # A replayed step logs again: the last line of a step is the one that counts.
        self._log_metrics(
            {"kind": "train", "step": self.step, "rollout_ids": list(batch.rollout_ids), **metrics}
        )
        return metrics

    def checkpoint(self) -> None:
        """Save the train state of `self.step` (unless saved already) and wait for it; then
        drop the journal entries that no kept checkpoint needs."""
        if self.step in self.checkpoints.steps():
            return
        self.checkpoints.save(
            self.learner.state,
            version=self.step,
            extra={"rollout_ids": self.last_rollout_ids, "metrics": self.last_metrics, **self._base_record()},
        )
        self.checkpoints.wait()
        self._trim_memory()  # the checkpoint's buffers, before the next update
        kept = self.checkpoints.steps()
        if kept and self.gang.leader:
            self.journal.prune(before=kept[0])  # restore falls back at most to the oldest kept

    def close(self) -> None:
        self.learner.stop_precompile()
        self.checkpoints.close()
        self.pusher.close()


def run(config: RunConfig, process_id: int = 0) -> int:
    """Serve the controller until it says the run is complete (`process_id`: this process
    in the gang of `trainer.hosts`)."""
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it touches at INFO

    gang = join_gang(config, process_id)  # before any JAX computation
    if gang.size > 1:
        check(config, process_id)  # what main's check left for after joining
    loop = TrainerLoop(config, gang)
    client = (
        ControlClient(
            config.controller.address,
            encode=encode_control,
            decode=decode_control,
            timeout_s=min(10.0, config.controller.request_timeout_s),
            role="trainer",
            resolve=resolver(config.addresses.book, "controller", config.controller.address),
        )
        if gang.leader
        else None
    )
    metrics = loop.last_metrics
    last_publish_check = 0.0
    step_ended = time.monotonic()  # from here the trainer waits for its next batch
    try:
        loop.publish()
        if config.trainer.precompile:
            loop.precompile()  # while the workers warm up and make the first batch
        while True:
            # The leader asks; every process acts on the same reply (and the same "time
            # to check the parameter server" decision, a clock only the leader reads).
            message = None
            if client is not None:
                reply = _ask(client, config, BatchRequest(trainer_step=loop.step, metrics=metrics))
                recheck = isinstance(reply, NoBatchYet) and time.monotonic() - last_publish_check > 5.0
                message = bytes([recheck]) + encode_control(reply)
            message = gang.broadcast_bytes(message)
            recheck, reply = bool(message[0]), decode_control(message[1:])
            if isinstance(reply, RunComplete):
                loop.checkpoint()  # the final weights, for `rlax convert to-hf` and resumption
                log.info("run complete at step %d; waiting to be stopped", reply.final_step)
                # Exiting now would look like a crash to the supervisor, which would restart
                # the trainer while the controller finishes; the controller's exit ends the run.
                time.sleep(config.controller.request_timeout_s)
                return 0
            if isinstance(reply, NoBatchYet):
                if recheck:
                    # A restarted parameter server may have lost the newest version.
                    last_publish_check = time.monotonic()
                    loop.publish()
                time.sleep(reply.retry_after_s)
                continue
            if isinstance(reply, TrainBatch):
                metrics = loop.train(reply, waited_s=time.monotonic() - step_ended)
                step_ended = time.monotonic()
                log.info("step %d done: %s", loop.step, {k: round(v, 4) for k, v in metrics.items()})
                continue
            raise RuntimeError(f"unexpected reply from the controller: {type(reply).__name__}")
    finally:
        if client is not None:
            client.close()
        loop.close()


def _ask(client: ControlClient, config: RunConfig, request: BatchRequest) -> Any:
    """The controller's reply, waiting through timeouts up to controller.request_timeout_s."""
    started = time.monotonic()
    while True:
        try:
            return client.call(request)
        except ProtocolTimeoutError as error:
            silent = time.monotonic() - started
            if silent > config.controller.request_timeout_s:
                raise TimeoutError(
                    f"no answer from the controller at {config.controller.address} for {silent:.0f}s "
                    f"(controller.request_timeout_s={config.controller.request_timeout_s}): {error}"
                ) from None


def check(config: RunConfig, process_id: int = 0, *, backend: bool = True) -> None:
    """Build the trainer's typed configs (`LearnerConfig` for RL and the SFT warm start, the
    task, the model's shapes); a `ConfigError` names the component that rejects the config.
    `backend=False`: only what needs no JAX backend (a gang member must join the gang
    before JAX starts its backend; `run` checks the rest once it has joined)."""
    select_platform(config.trainer.platform)  # before JAX starts a backend
    hosts = config.trainer.hosts
    if not 0 <= process_id < hosts:
        raise ConfigError(f"--process-id {process_id}: trainer.hosts = {hosts} (ids 0..{hosts - 1})")
    if not backend:
        return
    # The platform asked for, or an error: never a run on another device. Then the mesh
    # over the gang's devices (a gang not joined yet, as in `rlax launch`'s preflight,
    # counts this host's devices once per host).
    require_platform(config.trainer.platform, "trainer.platform")
    joined = jax.process_count() > 1
    mesh_axes(config, jax.device_count() if joined else jax.local_device_count() * hosts)
    for mode in ["rl", "sft"] if config.trainer.sft_steps else ["rl"]:
        rejected_by("the trainer", functools.partial(learner_config, config, mode=mode))
    task = rejected_by("the task (data.*)", lambda: build_task(config))
    checked_model_config(config, task.tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    """`rlax-trainer --config FILE [--process-id I] [key=value ...]` (also `rlax trainer`)."""

    def start(config: RunConfig, args: argparse.Namespace) -> int:
        use_compile_cache(config)
        exit_on_sigterm()
        return run(config, args.process_id)

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--process-id",
            type=int,
            default=0,
            help="this process in the gang of trainer.hosts processes joined by jax.distributed (0: the leader)",
        )

    return component_main(
        "rlax trainer",
        argv,
        start,
        # `--check-config` (the launcher's preflight) checks everything without joining.
        check=lambda config, args: check(
            config, args.process_id, backend=args.check_config or config.trainer.hosts == 1
        ),
        add_arguments=add_arguments,
    )


if __name__ == "__main__":
    sys.exit(main())
