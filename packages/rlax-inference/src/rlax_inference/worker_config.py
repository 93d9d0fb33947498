"""`WorkerConfig`: where an inference worker listens and how it follows the parameter server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlax_core.config import ConfigError, RunConfig
from rlax_inference.admission import RequestLimits
from rlax_inference.lora_weights import LoraApply

__all__ = ["WorkerConfig", "WorkerConfigError"]


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
    lora_apply: how a LoRA run's adapters are applied (`workers.lora_apply`, `LoraBase`).
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
    lora_apply: LoraApply = "unmerged"

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
            "lora_apply": config.workers.lora_apply,
        }
        return cls(**{**fields, **overrides})
