"""Messages of the verifier service: scoring completions and stepping environments."""

from __future__ import annotations

import math

from rlax_protocol.message_base import Message, reject_field


class VerifyRequest(Message, frozen=True):
    """Score `completion` with verifier `verifier` (``math``, ``exact_match``, ``code``, ...)
    against `reference`; `extra` carries verifier-specific inputs (tests, entry point)."""

    request_id: str
    verifier: str
    completion: str
    reference: str = ""
    extra: dict[str, str] = {}
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            reject_field("VerifyRequest", "timeout_s", self.timeout_s, "must be a finite number > 0")


class VerifyResult(Message, frozen=True):
    request_id: str
    reward: float
    correct: bool
    detail: str = ""


class VerifyBatch(Message, frozen=True):
    """A batch of `items` verifications; one raw frame follows, the JSON array of
    ``[completion, record]`` pairs (`rlax_data`'s record; its `task` names the verifier).
    `timeout_s` caps each sandboxed job of the batch (and the service caps it in turn: a
    client asks, the server's limits decide)."""

    request_id: str
    items: int
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.items < 1:
            raise ValueError(f"VerifyBatch.items={self.items}: must be >= 1")
        if not math.isfinite(self.timeout_s) or self.timeout_s <= 0:
            raise ValueError(f"VerifyBatch.timeout_s={self.timeout_s}: must be a finite number > 0")


class VerifyBatchResult(Message, frozen=True):
    """The answer to a `VerifyBatch`: one raw frame follows, the JSON array of per-item
    outcomes; `refused` items were not scored (their outcome says why)."""

    request_id: str
    items: int
    refused: int = 0


MAX_ENV_TURNS = 1024
"""Most model turns one `EnvStepRequest` may carry."""


class EnvStepRequest(Message, frozen=True):
    """Run one step of a multi-turn environment in the verifier service (scale-out of the
    workers' agent loops). The service makes environment `environment` (a registered
    `rlax_data.envs` name) with `options` (a JSON object: `format`, `max_result_chars`,
    `tool_timeout_s`), resets it with `record` (the prompt's record as JSON), replays the
    earlier model turns `turns[:-1]` (skipped for environments whose steps do not depend on
    each other) and answers the step of `turns[-1]` with an `EnvStepResult`. The request
    carries the whole trajectory so that any replica can serve it and a restarted service
    loses nothing. `timeout_s` bounds the whole request (at most the service's own maximum)."""

    request_id: str
    environment: str
    record: str
    turns: tuple[str, ...]
    options: str = "{}"
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.environment:
            reject_field("EnvStepRequest", "environment", self.environment, "must name an environment")
        if not 1 <= len(self.turns) <= MAX_ENV_TURNS:
            reject_field(
                "EnvStepRequest", "turns", f"<{len(self.turns)} turns>", f"needs 1 to {MAX_ENV_TURNS}"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            reject_field("EnvStepRequest", "timeout_s", self.timeout_s, "must be a finite number > 0")


class EnvStepResult(Message, frozen=True):
    """The environment's answer to the last turn of an `EnvStepRequest` (the fields of
    `rlax_data.envs.EnvStep`)."""

    request_id: str
    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    error: str = ""
    tool_correct: bool | None = None

    def __post_init__(self) -> None:
        for name in ("tool_calls", "tool_errors"):
            if getattr(self, name) < 0:
                reject_field("EnvStepResult", name, getattr(self, name), "must be >= 0")
        if self.reward is not None and not math.isfinite(self.reward):
            reject_field("EnvStepResult", "reward", self.reward, "must be finite")
