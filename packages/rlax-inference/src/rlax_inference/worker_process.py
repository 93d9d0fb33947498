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
import dataclasses
import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import rlax_protocol as rp
from rlax_core.addresses import resolver
from rlax_core.cli import component_main, exit_on_sigterm, select_platform
from rlax_core.config import EXIT_CONFIG_ERROR, ConfigError, RunConfig, rejected_by
from rlax_inference.admission import AdmissionQueue, Queued, RequestLimits
from rlax_inference.agent_loop import AgentLoop, AgentResult, TurnCodec
from rlax_inference.engine import ENGINE_OPTIONS, EngineConfig, LLMEngine, RequestOutput
from rlax_inference.sequence import SamplingParams
from rlax_inference.worker_io import Cancel, Job, WorkerIO
from rlax_model import ModelConfig, Params, dtype_policy
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

_MAX_BACKOFF_S = 30.0


class WorkerConfigError(ConfigError):
    """The worker's model or engine config is rejected (by itself or by the pulled weights)."""


@dataclass(frozen=True)
class WorkerConfig:
    """Where the worker listens and how it follows the parameter server.

    bind: ZeroMQ address of the ROUTER socket (loopback by default; port * picks one).
    paramserver: address of the parameter server.
    reload_staleness: reload once the newest version is this many versions ahead (j >= 1).
    weights_poll_s: how often the version is checked while generating (it is also checked
      before admitting new requests).
    rpc_timeout_s: deadline of each exchange of a pull; pull_retries: how often a timed-out
      exchange is repeated before the pull fails (the old weights stay; `reload_retry_s`
      later, doubling up to 30 s, it is tried again).
    first_weights_timeout_s: a worker without weights whose parameter server has not
      answered for this long gives up (TimeoutError).
    max_inflight_requests: requests queued or generating; beyond it a request is answered
      ``busy``. max_inflight_per_client: the same for one client (connection), so that one
      client cannot take every slot (None: half of `max_inflight_requests`, at least 1).
    version_wait_s: a request for a version this worker cannot load (the parameter server
      does not have it yet, or loading it keeps failing) is answered ``version_unavailable``
      after waiting this long (None: half of `rpc_timeout_s`); it never holds up requests
      for the loaded weights. One more than `max_version_lead` versions beyond the newest
      is refused at once; a version whose load failed `version_load_attempts` times (backing
      off from `reload_retry_s`) is refused with the error.
    limits: the server's maxima of a request's sizes and counts (`RequestLimits`; `n`, the
      prompt and `max_tokens` are bounded by the engine's sizes).
    client_heartbeat_s: ZMTP heartbeat interval towards clients (a silent connection is
      closed after five), so requests of a client whose host vanished are cancelled.
    follow_latest: reload the newest weights when `reload_staleness` behind even while no
      request waits for them; False (pinned versions): follow the newest only while a
      request that names no version is queued or generating, so a worker serving pinned
      requests loads only the versions they name (and the newest once, to start).
    map_weights: map a pulled version's state file when the parameter server is on this host
      (`ParamClient(local=...)`): the weights are the page cache's, shared, not a copy.
    max_delay_s: `chaos.max_delay_s`: sleep a random time up to this before each engine
      step (a test hook: timing must not change a pinned run).
    address_book: the run's address book (`addresses.book`); the parameter server's
      address is read there before each reconnect, so one that moved to another node is
      followed without a restart. Empty: `paramserver` for good.
    """

    bind: str = "tcp://127.0.0.1:*"
    paramserver: str = "tcp://127.0.0.1:5555"
    reload_staleness: int = 1
    weights_poll_s: float = 0.05
    rpc_timeout_s: float = 30.0
    pull_retries: int = 2
    reload_retry_s: float = 1.0
    first_weights_timeout_s: float = 120.0
    max_inflight_requests: int = 64
    client_heartbeat_s: float = 2.0
    worker_id: str = "worker"
    follow_latest: bool = True
    max_delay_s: float = 0.0
    map_weights: bool = True
    max_inflight_per_client: int | None = None
    version_wait_s: float | None = None
    max_version_lead: int = 4
    version_load_attempts: int = 3
    limits: RequestLimits = RequestLimits()
    address_book: str = ""

    def __post_init__(self) -> None:
        for name in ("reload_staleness", "max_inflight_requests"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"WorkerConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.pull_retries, int) or self.pull_retries < 0:
            raise ValueError(f"WorkerConfig.pull_retries must be an int >= 0, got {self.pull_retries!r}")
        for name in ("weights_poll_s", "rpc_timeout_s", "reload_retry_s", "first_weights_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"WorkerConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.client_heartbeat_s >= 0:
            raise ValueError(f"WorkerConfig.client_heartbeat_s must be >= 0, got {self.client_heartbeat_s!r}")
        for name, least in (
            ("max_inflight_per_client", 1),
            ("max_version_lead", 0),
            ("version_load_attempts", 1),
        ):
            value = getattr(self, name)
            if not (value is None and name == "max_inflight_per_client") and not (
                isinstance(value, int) and not isinstance(value, bool) and value >= least
            ):
                raise ValueError(f"WorkerConfig.{name} must be an int >= {least}, got {value!r}")
        if self.version_wait_s is not None and not self.version_wait_s > 0:
            raise ValueError(
                f"WorkerConfig.version_wait_s must be > 0 (or None), got {self.version_wait_s!r}"
            )

    @property
    def inflight_per_client(self) -> int:
        return self.max_inflight_per_client or max(1, self.max_inflight_requests // 2)

    @property
    def version_wait_limit_s(self) -> float:
        return self.rpc_timeout_s / 2 if self.version_wait_s is None else self.version_wait_s

    @classmethod
    def from_run(cls, config: RunConfig, index: int, **overrides: Any) -> WorkerConfig:
        """Worker `index` of the run `config` (`overrides`: any field, for tests and tools)."""
        fields = {
            "bind": config.workers.addresses[index],
            "paramserver": config.paramserver.address,
            "reload_staleness": config.workers.j,
            "first_weights_timeout_s": config.controller.request_timeout_s,
            "max_inflight_requests": config.workers.max_inflight_requests,
            "worker_id": f"worker{index}",
            "follow_latest": config.controller.versions == "freshest",
            "max_delay_s": config.chaos.max_delay_s,
            "map_weights": config.workers.map_weights,
            # The controller's requests (training and eval groups) always fit; a stranger gets half.
            "max_inflight_per_client": max(
                2 * config.workers.max_inflight_groups, config.workers.max_inflight_requests // 2
            ),
            # Answered before the controller's own timeout, so it reassigns the group at once.
            "version_wait_s": config.controller.request_timeout_s / 2,
            "limits": RequestLimits(
                max_agent_turns=max(RequestLimits.max_agent_turns, config.agent.max_turns),
                max_tool_timeout_s=max(RequestLimits.max_tool_timeout_s, config.agent.tool_timeout_s),
            ),
            "address_book": config.addresses.book,
        }
        return cls(**{**fields, **overrides})


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
    }


@dataclass(frozen=True)
class WarmUp:
    """The shapes to compile at the first weights: decode for up to `rows` rows at every
    block-table width and each of `decode_steps`; prefill of `sampling.n` samples of dummy
    prompts of `prompt_lengths` tokens (one token each), and of `prompt_counts` prompts
    prefilled together (groups that arrive at once share one prefill call, whose row
    buckets would otherwise compile in the middle of the run)."""

    rows: int
    decode_steps: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    sampling: SamplingParams
    prompt_counts: tuple[int, ...] = ()

    @classmethod
    def for_run(cls, config: RunConfig, task: Any) -> WarmUp:
        """One group's rows (up to the worker's in-flight groups), the shortest and the
        longest of the task's first prompts."""
        data, workers = config.data, config.workers
        try:
            lengths = sorted({len(task.encode_prompt(r)) for r in task.train_records()[:64]})
        except Exception as error:  # the prompts are not readable here: prefill compiles on first use
            log.warning("prefill warm-up skipped: cannot read the task's prompts (%s)", error)
            lengths = []
        room = config.model.max_seq_len - 1
        # Row buckets are powers of two: 2, 4, 8, ... prompts up to the groups a worker can
        # hold at once reach every prefill shape of the run.
        together = min(workers.max_inflight_groups, max(1, workers.max_num_seqs // data.group_size))
        counts = {min(2**i, together) for i in range(1, together.bit_length() + 1)} if together > 1 else set()
        return cls(
            prompt_counts=tuple(sorted(counts)),
            rows=min(workers.max_num_seqs, data.group_size * max(1, workers.max_inflight_groups)),
            decode_steps=tuple(sorted({1, workers.num_decode_steps})),
            prompt_lengths=tuple(sorted({max(1, min(n, room)) for n in (lengths[:1] + lengths[-1:])})),
            sampling=SamplingParams(
                n=min(data.group_size, workers.max_num_seqs),
                temperature=data.temperature,
                top_p=data.top_p,
                top_k=data.top_k,
                max_tokens=1,
            ),
        )


class _TailText:
    """`LLMEngine`'s `detokenize`: the text of a sample's last tokens, as many as can hold
    the longest stop string admitted so far (a character is at most 4 byte tokens), so each
    new token costs a bounded decode, not one of the whole sample."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.window = 1

    def need(self, stop: Sequence[str]) -> None:
        if stop:
            self.window = max(self.window, 4 * max(len(s) for s in stop) + 16)

    def __call__(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens[-self.window :]))


class Worker:
    """The worker: `start()` binds and starts the I/O thread, `run()` is the engine loop
    (until `stop()`); `Worker.from_run` builds the one a run config describes."""

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
        self.detokenize = None if tokenizer is None else _TailText(tokenizer)
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

    @classmethod
    def from_run(cls, config: RunConfig, index: int, **overrides: Any) -> Worker:
        """Worker `index` of the run: its address, the run's model, tokenizer, engine sizes
        and warm-up (`overrides`: `WorkerConfig` fields)."""
        from rlax_data.task_from_config import build_task
        from rlax_model.model_from_config import build_model_config

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
                self._admit(round_start)
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

    # -- weights -------------------------------------------------------------------------
    def _maybe_reload(self, now: float, *, force: bool) -> None:
        """Pull the newest weights if we have none or are `reload_staleness` or more versions behind."""
        if now < self._backoff_until or (not force and now < self._next_check):
            return
        self._next_check = now + self.config.weights_poll_s
        assert self._version_client is not None
        asked = time.monotonic()
        try:
            latest = self._version_client.latest()
        except rp.ProtocolError as error:
            waited = now - self._started
            if self.version is None and waited > self.config.first_weights_timeout_s:
                raise TimeoutError(
                    f"{self.config.worker_id}: no answer from the parameter server at {self.config.paramserver} "
                    f"for {waited:.0f}s (first_weights_timeout_s={self.config.first_weights_timeout_s}): {error}"
                ) from None
            self._failed("cannot reach the parameter server", error, now)
            return
        self.num_weight_checks += 1
        self._latest, self._latest_at = latest, asked
        if latest is None or (
            self.version is not None and latest - self.version < self.config.reload_staleness
        ):
            self._backoff_s = self.config.reload_retry_s
            return
        self._reload(latest)

    def _serving_unpinned(self) -> bool:
        """A request that names no version is queued or generating: it follows the newest."""
        return (
            any(q.version is None for q in self._queue)
            or any(request.weight_version is None for request in self._admitted.values())
            or (self.agent is not None and self.agent.serving_unpinned)
        )

    def _loadable(self, version: int, now: float) -> bool:
        """Can the worker try to load `version` now: published (as far as it last heard), and
        no failed load or unreachable parameter server backing off."""
        if self._latest is None or version > self._latest or now < self._backoff_until:
            return False
        failure = self._load_failures.get(version)
        return failure is None or now >= failure[1]

    def _requested_version(self, now: float) -> int | None:
        """The version the next queued request names, when it is not the loaded one, the
        worker can load it, and the engine has finished every request it holds (they need
        the loaded weights). Requests for versions it cannot load now are set aside."""
        if self.engine is None or self.engine.has_unfinished or not self._queue:
            return None
        if self.agent is not None and self.agent.active:
            return None  # its trajectories' next turns need the loaded weights
        return self._queue.next_version(self.version, lambda v: self._loadable(v, now))

    def _settle_versions(self, now: float) -> None:
        """Answer the queued requests whose version this worker cannot serve: beyond the
        newest by more than `max_version_lead` (at once), or not loadable after waiting
        `version_wait_s` (not published, or its load backing off after failures)."""
        pc = self.config
        waiting = [(q, q.version) for q in self._queue if q.version is not None and q.version != self.version]
        if not waiting:
            return
        if self._latest is None or any(version > self._latest for _, version in waiting):
            self._refresh_latest(now)
        latest, lead, wait_s = self._latest, pc.max_version_lead, pc.version_wait_limit_s
        for q, version in waiting:
            waited = now - q.since
            if latest is not None and self._latest_at >= q.since and version > latest + lead:
                why = (
                    f"weight version {version} is more than max_version_lead={lead} versions beyond "
                    f"the newest the parameter server holds ({latest}): refused at once"
                )
            elif waited >= wait_s and not self._loadable(version, now):
                failure = self._load_failures.get(version)
                why = (
                    f"weight version {version} is not available (the parameter server's newest is "
                    f"{latest}); waited {waited:.1f}s, the worker's version_wait_s={wait_s:g}"
                    + (f"; its last load failed: {failure[2]}" if failure else "")
                )
            else:
                continue
            self._refuse([q], "version_unavailable", why)

    def _refresh_latest(self, now: float) -> None:
        """Ask the parameter server for its newest version, at most every `weights_poll_s`."""
        if now < self._next_latest_check:
            return
        assert self._version_client is not None
        asked = time.monotonic()
        try:
            latest = self._version_client.latest()
        except rp.ProtocolError as error:
            # Each failed ask holds the engine thread up to its deadline: back off, doubling.
            retry_s = self._latest_backoff_s
            self._latest_backoff_s = min(_MAX_BACKOFF_S, 2 * retry_s)
            self._next_latest_check = now + retry_s
            log.warning("cannot ask the parameter server for its newest version (%s); again in %.1fs",
                        error, retry_s)  # fmt: skip
            return
        self._latest, self._latest_at = latest, asked
        self._latest_backoff_s = self.config.reload_retry_s
        self._next_latest_check = now + self.config.weights_poll_s

    def _refuse(self, queued: list[Queued], code: str, why: str) -> None:
        """Answer queued requests with an `ErrorReply` and take them out of the queue."""
        assert self.io is not None
        self._queue.remove({q.job.key for q in queued})
        for q in queued:
            self.num_refused[code] = self.num_refused.get(code, 0) + 1
            self.io.post(q.job.key, rp.ErrorReply(code=code, message=f"{_shown_id(q.job.request)}: {why}"))
        if queued:
            log.warning("%d request(s) refused (%s): %s", len(queued), code, why)

    def _load_requested(self, version: int, now: float) -> None:
        """Load `version` for the requests that name it. Refuse them when the parameter
        server no longer holds it (older than its `keep` newest); set them aside when it is
        not published yet; after a failed load, back off, and after `version_load_attempts`
        failures refuse them with the error."""
        from rlax_paramserver import VersionNotFoundError

        try:
            self._reload(version, exact=True)
        except VersionNotFoundError as error:
            assert self._version_client is not None
            asked = time.monotonic()
            try:
                latest = self._version_client.latest()
            except rp.ProtocolError as lost:
                self._load_failed(version, f"version {version} not found; the newest is unknown: {lost}")
                return
            self._latest, self._latest_at = latest, asked
            if latest is None or version > latest:
                log.info("version %d is not published yet (%s): its requests wait", version, error)
                return
            self._load_failures.pop(version, None)
            refused = [q for q in self._queue if q.version == version]
            self._refuse(
                refused, "not_found", f"weight version {version} is no longer held (newest {latest})"
            )
        except rp.ProtocolError as error:
            self._load_failed(version, f"pulling it from {self.config.paramserver} failed: {error}")
        else:
            self._load_failures.pop(version, None)

    def _load_failed(self, version: int, error: str) -> None:
        """A pinned version did not load: try again later (backing off), or, after
        `version_load_attempts`, answer its requests with the error."""
        attempts = self._load_failures.get(version, (0, 0.0, ""))[0] + 1
        limit = self.config.version_load_attempts
        if attempts >= limit:
            self._load_failures.pop(version, None)
            refused = [q for q in self._queue if q.version == version]
            why = f"loading weight version {version} failed {attempts} times (version_load_attempts={limit}): {error}"
            self._refuse(refused, "version_unavailable", why)
            return
        retry_s = min(_MAX_BACKOFF_S, self.config.reload_retry_s * 2 ** (attempts - 1))
        self._load_failures[version] = (attempts, time.monotonic() + retry_s, error)
        log.warning("loading version %d failed (%s); its requests wait, trying again in %.1fs (attempt %d of %d)",
                    version, error, retry_s, attempts, limit)  # fmt: skip

    def _failed(self, what: str, error: Exception, now: float) -> None:
        self._backoff_until = now + self._backoff_s
        log.warning(
            "%s (%s); generating with version %s, trying again in %.1fs",
            what,
            error,
            self.version,
            self._backoff_s,
        )
        self._backoff_s = min(_MAX_BACKOFF_S, 2 * self._backoff_s)

    def _reload(self, latest: int, *, exact: bool = False) -> None:
        """Pull the newest version (or, `exact`, version `latest` itself) and load it."""
        import jax
        import jax.numpy as jnp

        from rlax_paramserver import VersionNotFoundError

        first = self.engine is None
        previous, self.phase = self.phase, "loading" if first else "reloading"
        started = time.monotonic()
        assert self._pull_client is not None
        try:
            if exact:
                pulled = self._pull_client.pull(latest)
            else:
                pulled = self._pull_client.pull("latest", if_newer_than=self.version)
        except VersionNotFoundError:
            self.phase = previous
            raise
        except rp.ProtocolError as error:
            self.num_failed_pulls += 1
            self.phase = previous
            if exact:
                raise  # the requests that name it decide (`_load_requested`)
            self._failed(
                f"pulling version {latest} from {self.config.paramserver} failed", error, time.monotonic()
            )
            return
        if pulled is None:
            self.phase = previous
            return
        self._backoff_s = self.config.reload_retry_s
        if self.model_config is None:
            self.model_config = dtype_policy(_model_config_from(pulled.metadata))
        dtype = self.model_config.param_jnp_dtype
        # On the CPU, a mapped tensor of the right dtype (64-byte aligned in the file) becomes
        # a JAX array without a copy: the weights stay the page cache's, shared on this host.
        params: Params = jax.tree.map(lambda x: jnp.asarray(x, dtype=dtype), pulled.tree)
        self.shared_weight_bytes = _aliased_bytes(pulled.tree, params) if pulled.mapped else 0
        if self.engine is None:
            try:
                self.engine = LLMEngine(
                    self.model_config, params, self.engine_config,
                    weight_version=pulled.version, detokenize=self.detokenize,
                )  # fmt: skip
            except ValueError as error:  # e.g. max_model_len beyond the model's positions
                raise WorkerConfigError(str(error)) from None
            if self.turn_codec is not None:
                engine = self.engine
                self.agent = AgentLoop(
                    lambda: engine, self.turn_codec, max_model_len=self.engine_config.max_model_len
                )
        else:
            self.engine.update_weights(params, pulled.version)
            self.reloads += 1
        self.reload_s += time.monotonic() - started
        if first and self.warm_up is not None:
            self.phase = "warming up"
            self._warm_up(self.warm_up)
        log.info("loaded weights version %d (was %s)", pulled.version, self.version)
        self.version = pulled.version
        self.phase = "serving"

    def _warm_up(self, plan: WarmUp) -> None:
        """Compile the shapes the run will use before serving, and count the time as compile time.

        Decode: padding rows only (the cache is not written); prefill: a one-token request on a
        dummy prompt of each length (its blocks go back to the pool).
        """
        engine = self.engine
        assert engine is not None
        started = time.monotonic()
        row_count = min(8, plan.rows)
        while True:
            engine.runner.warmup(row_count, plan.decode_steps)
            if row_count >= plan.rows:
                break
            row_count = min(plan.rows, row_count * 2)
        for length in plan.prompt_lengths:
            engine.generate([[0] * length], plan.sampling)
        if plan.prompt_lengths:
            vocab, length = engine.runner.config.vocab_size, plan.prompt_lengths[-1]
            for count in plan.prompt_counts:
                # Distinct first tokens: no prompt shares another's prefix (or its cache).
                engine.generate([[i % vocab] + [0] * (length - 1) for i in range(count)], plan.sampling)
        self.compile_s += time.monotonic() - started
        log.info(
            "compiled the run's shapes (up to %d rows) in %.1fs (%s)",
            plan.rows,
            self.compile_s,
            dict(engine.runner.num_compilations),
        )

    # -- requests --------------------------------------------------------------------------
    def _take_inbox(self, wait_s: float) -> None:
        assert self.io is not None
        inbox = self.io.inbox
        try:
            item = inbox.get(timeout=wait_s) if wait_s > 0 else inbox.get_nowait()
            while True:
                if isinstance(item, Job):
                    self._intake(item)
                else:
                    self._cancel(item)
                item = inbox.get_nowait()
        except queue.Empty:
            return

    def _intake(self, job: Job) -> None:
        """Queue a decoded request, or refuse it at once when it asks for more than this
        worker gives (`RequestLimits`, the engine's sizes)."""
        ec = self.engine_config
        why = self.config.limits.check(
            job.request, max_num_seqs=ec.max_num_seqs, max_model_len=ec.max_model_len
        )
        if why is None:
            self._queue.add(job, time.monotonic())
            return
        assert self.io is not None
        self.num_refused["too_large"] += 1
        self.io.post(job.key, rp.ErrorReply(code="too_large", message=f"{_shown_id(job.request)}: {why}"))

    def _cancel(self, cancel: Cancel) -> None:
        """The client is gone: forget a queued request, abort an admitted one (its blocks are freed)."""
        self._queue.remove({cancel.key})
        if self.agent is not None:
            self.agent.cancel(cancel.key)
        if self._admitted.pop(cancel.key, None) is not None and self.engine is not None:
            self.engine.abort(str(cancel.key))
            self.num_aborted += 1

    def _admit(self, now: float) -> None:
        """Move queued requests into the engine, round robin across clients (`AdmissionQueue`),
        while it has room for their samples: the rest wait here, where a client that was not
        served for a while goes first, rather than in the engine's arrival-ordered queue."""
        engine, io = self.engine, self.io
        assert engine is not None and io is not None
        capacity = self.engine_config.max_num_seqs
        room = capacity - _engine_sequences(engine)
        for queued in self._queue.admissible(self.version, lambda v: self._loadable(v, now)):
            job, request = queued.job, queued.job.request
            if request.n > room and room < capacity:
                break  # the engine is full; this client keeps its turn
            self._queue.served(queued)
            try:
                params = _engine_params(request)
                if self.detokenize is not None:
                    self.detokenize.need(params.stop)
                if request.agent is not None:
                    if self.agent is None:
                        raise ValueError(
                            "agent: this worker was started without the run's task (no environments)"
                        )
                    if self.detokenize is not None:
                        self.detokenize.need(self.agent.codec.stop_strings)
                    self.agent.start(job.key, request, params)
                    room -= request.n
                    continue
                engine.add_request(str(job.key), request.prompt_token_ids, params)
            except Exception as error:  # a request the engine refuses fails alone, before it is scheduled
                if not isinstance(error, ValueError | TypeError | OverflowError):
                    log.exception("request %r refused", request.request_id)
                message = str(error).replace(f"request '{job.key}'", f"request {request.request_id!r}")
                if request.request_id not in message:
                    message = f"{request.request_id}: {message}"
                io.post(job.key, rp.ErrorReply(code="malformed", message=message))
                continue
            room -= request.n
            self._admitted[job.key] = request

    def _step(self, round_start: float) -> None:
        engine = self.engine
        assert engine is not None
        if self.config.max_delay_s > 0:  # chaos.max_delay_s; unseeded: timing is the point
            time.sleep(random.uniform(0.0, self.config.max_delay_s))
            round_start = time.monotonic()
        compiled_before = dict(engine.runner.num_compilations)
        started = time.monotonic()
        outputs = engine.step()
        ended = time.monotonic()
        if engine.runner.num_compilations != compiled_before:
            self.compile_s += ended - started  # a shape the warm-up did not cover
            round_start = ended  # not generation time either
            new = {k: v - compiled_before.get(k, 0) for k, v in engine.runner.num_compilations.items()}
            log.info("compiled new shapes during the run in %.1fs: %s", ended - started, new)
        else:
            self.engine_s += ended - started
        self.active_s += ended - round_start  # this round's version check, reload and step
        for output in outputs:
            if self.agent is not None and self.agent.owns(output.request_id):
                self._post_agent_results(self.agent.on_output(output))
            else:
                self._finish(output)

    def _post_agent_results(self, results: list[AgentResult]) -> None:
        assert self.io is not None
        for key, request, samples, version in results:
            self.generated_tokens += sum(sum(s.model_mask) for s in samples)
            result = rp.GenerateResult(
                request_id=request.request_id,
                samples=tuple(samples),
                weight_version=(self.version or 0) if version is None else version,
                stats=self.stats(),
            )
            self.io.post(key, result)

    def _finish(self, output: RequestOutput) -> None:
        assert self.io is not None
        key = int(output.request_id)
        request = self._admitted.pop(key, None)
        if request is None:
            return  # cancelled
        if output.error:
            message = f"{request.request_id}: {output.error}"
            self.io.post(key, rp.ErrorReply(code="internal", message=message))
            return
        with_logprobs = request.sampling.logprobs
        samples = tuple(
            rp.Sample(
                token_ids=tuple(int(t) for t in c.tokens),
                logprobs=tuple(float(x) for x in c.logprobs) if with_logprobs else (),
                finish_reason=c.finish_reason.wire,  # type: ignore[arg-type]
                top_logprobs=tuple({int(i): float(lp) for i, lp in t} for t in c.top_logprobs),
            )
            for c in sorted(output.outputs, key=lambda c: c.sample_index)
        )
        version = output.weight_version
        self.generated_tokens += sum(len(s.token_ids) for s in samples)
        result = rp.GenerateResult(
            request_id=request.request_id,
            samples=samples,
            weight_version=(self.version or 0) if version is None else version,
            stats=self.stats(),
        )
        self.io.post(key, result)

    def stats(self) -> rp.WorkerStats:
        return rp.WorkerStats(
            generated_tokens=self.generated_tokens,
            active_s=self.active_s,
            engine_s=self.engine_s,
            compile_s=self.compile_s,
            reload_s=self.reload_s,
            reloads=self.reloads,
            shared_weight_bytes=self.shared_weight_bytes,
        )


def _aliased_bytes(source: Any, params: Any) -> int:
    """Bytes of `params` (JAX arrays) that use `source`'s (numpy arrays') memory as is."""
    import jax

    total = 0
    for host, array in zip(jax.tree.leaves(source), jax.tree.leaves(params), strict=True):
        try:
            same = array.unsafe_buffer_pointer() == host.ctypes.data
        except (AttributeError, RuntimeError, ValueError):  # sharded or on an accelerator
            same = False
        total += int(host.nbytes) if same else 0
    return total


def _engine_sequences(engine: LLMEngine) -> int:
    """Samples in the engine that have not finished (waiting, prefilling or running)."""
    scheduler = engine.scheduler
    jobs = (*scheduler.waiting, *scheduler.prefilling)
    return len(scheduler.running) + sum(len(job.seqs) for job in jobs)


def _shown_id(request: rp.GenerateRequest) -> str:
    """The request's id for a reply or a log line (a hostile one cut short)."""
    rid = request.request_id
    return rid if len(rid) <= 80 else f"{rid[:80]}...({len(rid)} chars)"


def _engine_params(request: rp.GenerateRequest) -> SamplingParams:
    """Protocol sampling settings -> engine `SamplingParams` (ValueError names a bad field).

    A request without a seed keeps `seed=None`: the engine gives each such request its own.
    """
    s = request.sampling
    return SamplingParams(
        n=request.n,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop_strings),
        logprobs=s.top_logprobs,
    )


def _model_config_from(metadata: dict[str, Any]) -> ModelConfig:
    raw = metadata.get("model_config")
    if not isinstance(raw, dict):
        raise WorkerConfigError(
            "the pulled weights carry no metadata['model_config'] (a dict of ModelConfig fields); "
            "give the worker its model config"
        )
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise WorkerConfigError(f"metadata['model_config']: unknown ModelConfig fields {unknown}")
    return ModelConfig(**raw)


def check(config: RunConfig, index: int) -> None:
    """Build the worker's typed configs (`EngineConfig`, `WorkerConfig`, the task's tokenizer,
    the model's shapes); a `ConfigError` names the component that rejects the config."""
    from rlax_data.task_from_config import build_task
    from rlax_model.model_from_config import checked_model_config

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
        from rlax_model.model_from_config import require_platform, use_compile_cache

        # Here, not in `check`: `rlax launch` runs the trainer's and a worker's checks at
        # once, and two processes must not both open one host's accelerator.
        require_platform(config.workers.platform, "workers.platform")
        use_compile_cache(config)
        exit_on_sigterm()
        worker = Worker.from_run(config, args.index)
        address = worker.start()
        log.info("worker %d serving at %s (j=%d)", args.index, address, config.workers.j)
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
    import sys

    sys.exit(main())
