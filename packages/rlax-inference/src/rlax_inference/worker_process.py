"""`rlax-worker` (also `rlax worker`): the inference worker process.

Two threads, and only one of them runs the model:

- the I/O thread (`rlax_inference.worker_io.WorkerIO`) owns the ROUTER socket speaking
  `rlax_protocol` (`Hello` -> `Welcome`, `GenerateRequest` -> `GenerateResult` or
  `ErrorReply`). It answers `Hello` at once, whatever the engine is doing (compiling,
  reloading, stepping), queues requests for the engine thread, answers ``busy`` beyond
  `WorkerConfig.max_inflight_requests` (or beyond one client's `max_inflight_per_client`),
  and cancels the requests of a client that disconnected;
- the engine thread (the caller of `Worker.run`; the main thread of the process) follows the
  parameter server, admits requests, steps `LLMEngine` and posts results. It never touches
  the socket.

Admission (`rlax_inference.admission`): a request asking for more than a server maximum
(`WorkerConfig.limits`, the engine's sizes) is answered ``too_large`` at once, naming the
field and the limit; the others enter the engine round robin across clients while it has
room for their samples, so one client's many requests cannot starve another's.

Weights: a request that names a `weight_version` (the controller's pinned versions) is
generated with exactly that version. Requests for the loaded version are admitted until one
for another version the worker can load arrived before them; once the engine has finished
the ones it holds, the worker loads that version (older or newer: the parameter server keeps
the last `keep`). A request for a version the parameter server does not have yet is set
aside, never holding up the others, and answered ``version_unavailable`` after
`version_wait_s` (at once when it is more than `max_version_lead` beyond the newest); a
pinned load that fails is tried `version_load_attempts` times, backing off, then its
requests are answered with the error.

Requests without a version follow the newest weights (`follow_latest`): before admitting
new requests (and every `weights_poll_s` while generating) the engine thread asks
the parameter server for its newest version, and reloads only when it is
`reload_staleness` (the paper's j, `workers.j`) or more versions behind. A reload drops the
partly generated samples (they restart under the new weights), so every result is generated
by exactly one version, which it carries. A pull has a deadline per exchange and a bounded
number of retries; a failed pull keeps the old weights, is logged, and is tried again later
(backing off): a parameter server that stops answering holds generation up for at most one
pull's deadlines at a time, and the socket never.

At its first weights the worker compiles the shapes the run will use (`WarmUp`), so that
generation runs at the engine's warm speed; every result carries the worker's running totals
(`WorkerStats`), and an engine step that had to compile a new shape counts as compile time.

A request the engine refuses (a field out of range for this model: `top_k=1000` on a
128-token vocabulary, a prompt token outside the vocabulary, ...) gets an
`ErrorReply(code="malformed")` naming the field before anything is scheduled. Stop strings
are matched on the text the run's tokenizer decodes from each sample's latest tokens.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import rlax_protocol as rp
from rlax_core.addresses import resolver
from rlax_core.cli import component_main, exit_on_sigterm, select_platform
from rlax_core.config import EXIT_CONFIG_ERROR, ConfigError, RunConfig, rejected_by
from rlax_data.task_from_config import build_task
from rlax_inference.admission import AdmissionQueue
from rlax_inference.agent_loop import AgentLoop, TurnCodec
from rlax_inference.engine import EngineConfig, LLMEngine, RequestOutput
from rlax_inference.engine_config import ENGINE_OPTIONS
from rlax_inference.lora_weights import LoraBase
from rlax_inference.warm_up import WarmUp
from rlax_inference.worker_config import WorkerConfig, WorkerConfigError
from rlax_inference.worker_io import WorkerIO
from rlax_inference.worker_requests import RequestServing, TailText
from rlax_inference.worker_weights import WeightFollowing
from rlax_model import ModelConfig, dtype_policy
from rlax_model.model_from_config import (
    build_model_config,
    checked_model_config,
    require_platform,
    use_compile_cache,
)
from rlax_paramserver import ParamClient

__all__ = [
    "EXIT_CONFIG_ERROR",
    "WarmUp",
    "Worker",
    "WorkerConfig",
    "WorkerConfigError",
    "check",
    "engine_config_fields",
    "main",
]

log = logging.getLogger("rlax.worker")


def engine_config_fields(config: RunConfig, index: int = 0) -> dict[str, Any]:
    """`rlax_inference.EngineConfig` fields of the run: the `workers:` engine options as they
    are (same names, `ENGINE_OPTIONS`), the cache sized so that every running sequence can
    hold `model.max_seq_len` tokens. Unseeded requests draw from a stream seeded by the run
    and the worker's index (distinct across workers). `trainer.batch_invariant` turns on
    the engine's aligned mode: the workers' log-probs then equal the trainer's to the bit."""
    workers, max_len = config.workers, config.model.max_seq_len
    blocks_per_seq = -(-max_len // workers.block_size) + 1
    return {
        **{name: getattr(workers, name) for name in ENGINE_OPTIONS},
        "num_blocks": workers.max_num_seqs * blocks_per_seq + 8,
        "max_model_len": max_len,
        "swap_policy": "drop",
        "seed": (config.run.seed * 1_000_003 + index) % 2**31,
        "aligned": config.trainer.batch_invariant,
        "keep_stale_kv": workers.resume_kv == "keep",
        # Prefill rides in a decode call only through programs compiled at the warm-up.
        "fold_prefill": "compiled" if workers.fold_prefill else "off",
    }


class Worker(RequestServing, WeightFollowing):
    """The worker: `start()` binds and starts the I/O thread, `run()` is the engine loop
    (until `stop()`); `Worker.from_run` builds the one a run config describes. Requests are
    served by `RequestServing`'s methods, weights loaded by `WeightFollowing`'s."""

    def __init__(
        self,
        config: WorkerConfig,
        engine_config: EngineConfig,
        model_config: ModelConfig | None = None,
        *,
        tokenizer: Any = None,
        warm_up: WarmUp | None = None,
        turn_codec: TurnCodec | None = None,
    ) -> None:
        self.config = config
        self.engine_config = engine_config
        # bfloat16 on a CPU computes in float32 (and says so), as the trainer does: same numerics.
        # Without a model config, the one the first pulled weights carry in their metadata.
        self.model_config = None if model_config is None else dtype_policy(model_config)
        self.detokenize = None if tokenizer is None else TailText(tokenizer)
        self.warm_up = warm_up
        self.turn_codec = turn_codec
        self.agent: AgentLoop | None = None  # multi-turn requests, once the engine exists
        self.server_id = f"{config.worker_id}-{uuid.uuid4().hex[:8]}"
        self.engine: LLMEngine | None = None
        self.version: int | None = None
        self.io: WorkerIO | None = None
        self.phase = "not started"  # for logs and tests: waiting for weights, loading, warming up, ...
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        # Decoded, not in the engine yet: no weights yet, a reload first, or no room.
        self._queue = AdmissionQueue()
        self._admitted: dict[int, rp.GenerateRequest] = {}
        self._resumed: dict[int, list[RequestOutput | None]] = {}
        self._next_check = 0.0
        self._backoff_s = config.reload_retry_s
        self._backoff_until = 0.0
        # The parameter server's newest version as last heard (and when it was asked), and the
        # failed loads of pinned versions: version -> (attempts, next try, last error).
        self._latest: int | None = None
        self._latest_at = -1.0
        self._next_latest_check = 0.0
        self._latest_backoff_s = config.reload_retry_s
        self._load_failures: dict[int, tuple[int, float, str]] = {}
        self.num_refused = {"too_large": 0, "version_unavailable": 0, "not_found": 0}
        self._started = time.monotonic()
        self.num_weight_checks = 0
        self.num_failed_pulls = 0
        self.num_aborted = 0
        # WorkerStats totals.
        self.reloads = 0
        self.generated_tokens = 0
        self.active_s = 0.0  # wall seconds with unfinished requests
        self.engine_s = 0.0  # inside engine steps that compiled nothing
        self.compile_s = 0.0  # start-up warm-up plus engine steps that compiled a new shape
        self.reload_s = 0.0
        self.shared_weight_bytes = 0
        self._version_client: ParamClient | None = None
        self._pull_client: ParamClient | None = None
        self.lora_base = LoraBase(self._pull_base, config.lora_apply)

    @classmethod
    def from_run(cls, config: RunConfig, index: int, **overrides: Any) -> Worker:
        """Worker `index` of the run: its address, the run's model, tokenizer, engine sizes
        and warm-up (`overrides`: `WorkerConfig` fields)."""
        task = build_task(config)
        return cls(
            WorkerConfig.from_run(config, index, **overrides),
            EngineConfig(**engine_config_fields(config, index)),
            build_model_config(config, task.tokenizer),
            tokenizer=task.tokenizer,
            warm_up=WarmUp.for_run(config, task),
            turn_codec=task.agent_turns(),
        )

    # -- lifecycle -------------------------------------------------------------------------
    @property
    def address(self) -> str | None:
        return None if self.io is None else self.io.address

    def start(self) -> str:
        """Bind and start answering (`Hello` at once, requests once weights arrive); returns the address."""
        self.io = WorkerIO(
            self.config.bind,
            server_id=self.server_id,
            max_inflight=self.config.max_inflight_requests,
            max_inflight_per_client=self.config.inflight_per_client,
            heartbeat_s=self.config.client_heartbeat_s,
        )
        self.io.start()
        self._started = time.monotonic()
        self.phase = "waiting for weights"
        return self.io.address

    def stop(self) -> None:
        """Ask `run()` to return (from any thread or a signal handler)."""
        self._stop.set()

    def run(self) -> None:
        """The engine loop, until `stop()`; closes the socket when it returns or raises."""
        io = self.io
        assert io is not None, "call start() first"
        pc = self.config
        self._version_client = ParamClient(
            pc.paramserver,
            timeout_s=min(1.0, pc.rpc_timeout_s),
            retries=0,
            client_id=pc.worker_id,
            resolve=resolver(pc.address_book, "paramserver", pc.paramserver),
        )
        self._pull_client = ParamClient(
            pc.paramserver,
            timeout_s=pc.rpc_timeout_s,
            retries=pc.pull_retries,
            client_id=pc.worker_id,
            local=pc.map_weights,
            resolve=resolver(pc.address_book, "paramserver", pc.paramserver),
        )
        try:
            while not self._stop.is_set():
                if io.error is not None:
                    raise RuntimeError(f"the worker's I/O thread failed: {io.error!r}") from io.error
                busy = self.engine is not None and self.engine.has_unfinished
                in_tools = self.agent is not None and self.agent.active
                self._take_inbox(0.0 if busy else 0.002 if in_tools else pc.weights_poll_s)
                round_start = time.monotonic()
                set_apart = self.reload_s + self.compile_s
                self._settle_versions(round_start)
                wanted = self._requested_version(round_start)
                if wanted is not None:
                    self._load_requested(wanted, round_start)
                elif in_tools:
                    pass  # a trajectory in flight keeps the loaded weights until it ends
                elif pc.follow_latest or self.engine is None or self._serving_unpinned():
                    self._maybe_reload(round_start, force=any(q.version is None for q in self._queue))
                # A weight load (and the first load's warm-up) is counted in reload_s and
                # compile_s, not as this round's generation time.
                round_start += self.reload_s + self.compile_s - set_apart
                if self.engine is None:
                    continue
                self._admit(functools.partial(self._loadable, now=round_start))
                if self.engine.has_unfinished:
                    self._step(round_start)
                if self.agent is not None and self.agent.active:
                    self._post_agent_results(self.agent.poll())
        except BaseException as error:
            if not isinstance(error, SystemExit | KeyboardInterrupt):
                self.errors.append(error)
            raise
        finally:
            if self.agent is not None:
                self.agent.close()
            io.stop()
            self._version_client.close()
            self._pull_client.close()


def check(config: RunConfig, index: int) -> None:
    """Build the worker's typed configs (`EngineConfig`, `WorkerConfig`, the task's tokenizer,
    the model's shapes); a `ConfigError` names the component that rejects the config."""
    if not 0 <= index < len(config.workers.addresses):
        raise ConfigError(f"--index {index}: the config has {len(config.workers.addresses)} worker addresses")
    select_platform(config.workers.platform)  # before JAX starts a backend
    rejected_by(
        "the inference engine (workers.*)", lambda: EngineConfig(**engine_config_fields(config, index))
    )
    rejected_by("the worker (workers.*)", lambda: WorkerConfig.from_run(config, index))
    task = rejected_by("the task (data.*)", lambda: build_task(config))
    checked_model_config(config, task.tokenizer)


def main(argv: Sequence[str] | None = None) -> int:
    """`rlax-worker --config FILE --index I [key=value ...] [--check-config]` (also `rlax worker`)."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--index", type=int, required=True, help="which of workers.addresses to serve")

    def start(config: RunConfig, args: argparse.Namespace) -> int:
        # Here, not in `check`: `rlax launch` runs the trainer's and a worker's checks at
        # once, and two processes must not both open one host's accelerator.
        require_platform(config.workers.platform, "workers.platform")
        use_compile_cache(config)
        exit_on_sigterm()
        worker = Worker.from_run(config, args.index)
        address = worker.start()
        log.info("worker %d serving at %s (j=%d)", args.index, address, config.workers.j)
        if worker.engine_config.keep_stale_kv:
            log.warning(
                "workers.resume_kv: keep: a resumed sample continues from stale K/V where this "
                "worker still holds them, which depends on timing: the run is not bitwise repeatable"
            )
        worker.run()
        return 0

    return component_main(
        "rlax worker",
        argv,
        start,
        check=lambda config, args: check(config, args.index),
        add_arguments=add_arguments,
    )


if __name__ == "__main__":
    sys.exit(main())
