"""The worker's weights: following the parameter server's newest version, loading the versions
that requests name, and answering the requests whose version it cannot serve.

`WeightFollowing` is one half of `rlax_inference.worker_process.Worker` (the other,
`rlax_inference.worker_requests.RequestServing`, admits and generates); the engine thread
calls both. Requests for the loaded version are admitted until one for another version the
worker can load arrived before them; once the engine has finished the ones it holds, the
worker loads that version. A request for a version the parameter server does not have yet
is set aside and answered ``version_unavailable`` after `version_wait_s`; a pinned load
that fails is tried `version_load_attempts` times, backing off. A failed pull of the newest
keeps the old weights and is tried again later, backing off.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax

import rlax_protocol as rp
from rlax_inference.admission import AdmissionQueue, Queued
from rlax_inference.agent_loop import AgentLoop, TurnCodec
from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.lora_weights import LoraBase, as_params
from rlax_inference.warm_up import WarmUp, compile_run_shapes
from rlax_inference.worker_config import WorkerConfig, WorkerConfigError
from rlax_inference.worker_io import WorkerIO
from rlax_inference.worker_requests import TailText, shown_id
from rlax_model import ModelConfig, Params, dtype_policy
from rlax_paramserver import ParamClient, PulledWeights, VersionNotFoundError
from rlax_protocol.lora_versions import LoraVersionError

__all__ = ["WeightFollowing"]

log = logging.getLogger("rlax.worker")

_MAX_BACKOFF_S = 30.0


class WeightFollowing:
    """The weight-following half of `Worker` (whose `__init__` sets every attribute below)."""

    config: WorkerConfig
    engine_config: EngineConfig
    model_config: ModelConfig | None
    engine: LLMEngine | None
    agent: AgentLoop | None
    turn_codec: TurnCodec | None
    detokenize: TailText | None
    warm_up: WarmUp | None
    io: WorkerIO | None
    version: int | None
    phase: str
    _queue: AdmissionQueue
    _admitted: dict[int, rp.GenerateRequest]
    _started: float
    _next_check: float
    _backoff_s: float
    _backoff_until: float
    # The parameter server's newest version as last heard (and when it was asked), and the
    # failed loads of pinned versions: version -> (attempts, next try, last error).
    _latest: int | None
    _latest_at: float
    _next_latest_check: float
    _latest_backoff_s: float
    _load_failures: dict[int, tuple[int, float, str]]
    _version_client: ParamClient | None
    _pull_client: ParamClient | None
    lora_base: LoraBase
    num_refused: dict[str, int]
    num_weight_checks: int
    num_failed_pulls: int
    reloads: int
    compile_s: float
    reload_s: float
    shared_weight_bytes: int

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
            self.io.post(q.job.key, rp.ErrorReply(code=code, message=f"{shown_id(q.job.request)}: {why}"))
        if queued:
            log.warning("%d request(s) refused (%s): %s", len(queued), code, why)

    def _load_requested(self, version: int, now: float) -> None:
        """Load `version` for the requests that name it. Refuse them when the parameter
        server no longer holds it (older than its `keep` newest); set them aside when it is
        not published yet; after a failed load, back off, and after `version_load_attempts`
        failures refuse them with the error."""
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
        first = self.engine is None
        previous, self.phase = self.phase, "loading" if first else "reloading"
        started = time.monotonic()
        assert self._pull_client is not None
        try:
            if exact:
                pulled = self._pull_client.pull(latest)
            else:
                pulled = self._pull_client.pull("latest", if_newer_than=self.version)
            params = None if pulled is None else self._engine_params(pulled)
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
        if pulled is None or params is None:
            self.phase = previous
            return
        self._backoff_s = self.config.reload_retry_s
        assert self.model_config is not None  # set by `_engine_params`
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

    def _pull_base(self, version: int) -> PulledWeights | None:
        """A LoRA run's base version, whole (`LoraBase` asks once per base)."""
        assert self._pull_client is not None
        return self._pull_client.pull(version)

    def _engine_params(self, pulled: PulledWeights) -> Params:
        """The engine's weights of a pulled version: its arrays, or for a LoRA run's
        adapter-only version its adapters merged into the base (pulled once, `LoraBase`).
        A malformed LoRA version or a base that is not the run's raises `ProtocolError`."""
        if self.model_config is None:
            self.model_config = dtype_policy(_model_config_from(pulled.metadata))
        dtype = self.model_config.param_jnp_dtype
        try:
            lora_params = self.lora_base.params(pulled, dtype)
        except LoraVersionError as error:
            raise rp.ProtocolError(f"version {pulled.version}: {error}") from None
        if lora_params is not None:
            self.shared_weight_bytes = 0
            return lora_params
        # On the CPU, a mapped tensor of the right dtype (64-byte aligned in the file) becomes
        # a JAX array without a copy: the weights stay the page cache's, shared on this host.
        params = as_params(pulled.tree, dtype)
        self.shared_weight_bytes = _aliased_bytes(pulled.tree, params) if pulled.mapped else 0
        return params

    def _warm_up(self, plan: WarmUp) -> None:
        """Compile the shapes the run will use before serving, and count the time as compile time."""
        engine = self.engine
        assert engine is not None
        self.compile_s += compile_run_shapes(engine, plan)
        log.info(
            "compiled the run's shapes (up to %d rows) in %.1fs (%s)",
            plan.rows,
            self.compile_s,
            dict(engine.runner.num_compilations),
        )


def _aliased_bytes(source: Any, params: Any) -> int:
    """Bytes of `params` (JAX arrays) that use `source`'s (numpy arrays') memory as is."""
    total = 0
    for host, array in zip(jax.tree.leaves(source), jax.tree.leaves(params), strict=True):
        try:
            same = array.unsafe_buffer_pointer() == host.ctypes.data
        except (AttributeError, RuntimeError, ValueError):  # sharded or on an accelerator
            same = False
        total += int(host.nbytes) if same else 0
    return total


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
