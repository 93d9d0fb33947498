"""Typed wire messages of RLAX (DESIGN.md §3).

Every message is a frozen, tagged `msgspec.Struct` encoded with msgpack; the tag (the
class name, in field ``type``) tells one message type from another, so a single
decoder reads any of them and a message of the wrong type is an error, not a guess.
Tensors never travel inside these structs: a `TensorManifest` describes them and the
bytes follow as raw frames (see `rlax_protocol.codec`).

`Hello` and `Welcome` must keep their tag and fields forever: they are what two peers
of different protocol versions still understand, so that a mismatch can be reported.
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar, Union

import msgspec

from rlax_protocol.bounds import MAX_MESSAGE_BYTES, MAX_MESSAGE_DEPTH, check_msgpack_bounds
from rlax_protocol.errors import MalformedMessageError

PROTOCOL_VERSION = 1
"""Bumped whenever a message changes incompatibly; exchanged in `Hello`/`Welcome` and every manifest."""

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "bool": 1,
}
"""Tensor dtypes the codec carries (by numpy name), with their size in bytes."""

MAX_RANK = 16
FinishReason = Literal["stop", "length", "abort"]


class Message(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Base of every wire message; the tag is the class name."""


def _fail(struct: str, field: str, value: object, why: str) -> None:
    raise ValueError(f"{struct}.{field}={value!r}: {why}")


# --------------------------------------------------------------------------- handshake


class Hello(Message, frozen=True):
    """First message from a client on a new connection."""

    protocol_version: int
    client_id: str = ""
    role: str = ""


class Welcome(Message, frozen=True):
    """Server's answer to `Hello`; `accepted` is False when the versions differ."""

    protocol_version: int
    server_id: str = ""
    accepted: bool = True
    reason: str = ""


class ErrorReply(Message, frozen=True):
    """Answer to a request that could not be served. `code` is machine-readable
    (``malformed``, ``unknown_message``, ``version_mismatch``, ``not_found``, ``stale_version``,
    ``too_large``, ``out_of_order``, ``checksum``, ``handshake_required``, ``forbidden``: the
    sender's role may not send this, ``busy``: retry later or elsewhere, ``version_unavailable``:
    a worker could not get the asked weight version within its limit, ``internal``)."""

    code: str
    message: str


class Ack(Message, frozen=True):
    """Plain success answer carrying no data."""


# --------------------------------------------------------------------------- tensors


class TensorHeader(Message, frozen=True):
    """One tensor of a tree: `name` is its slash-joined path (``layers/0/attn/q``),
    `checksum` the xxh3_64 of its raw little-endian C-order bytes."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    checksum: int

    def __post_init__(self) -> None:
        if not self.name or any(part == "" for part in self.name.split("/")):
            _fail("TensorHeader", "name", self.name, "must be a non-empty slash path without empty parts")
        if self.dtype not in DTYPE_ITEMSIZE:
            _fail("TensorHeader", "dtype", self.dtype, f"unsupported; allowed: {sorted(DTYPE_ITEMSIZE)}")
        if len(self.shape) > MAX_RANK or any(d < 0 for d in self.shape):
            _fail("TensorHeader", "shape", self.shape, f"dims must be >= 0 and rank <= {MAX_RANK}")
        expected = math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]
        if self.nbytes != expected:
            _fail(
                "TensorHeader",
                "nbytes",
                self.nbytes,
                f"shape {self.shape} of {self.dtype} holds {expected} bytes",
            )
        if not 0 <= self.checksum < 2**64:
            _fail("TensorHeader", "checksum", self.checksum, "must be an unsigned 64-bit integer")


class TensorManifest(Message, frozen=True):
    """Describes a tensor tree sent as raw frames. Tensor ``i`` occupies
    ``max(1, ceil(nbytes / chunk_bytes))`` consecutive frames, tensors in manifest order;
    every frame but a tensor's last holds exactly `chunk_bytes` bytes."""

    protocol_version: int
    chunk_bytes: int
    tensors: tuple[TensorHeader, ...]

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            _fail("TensorManifest", "chunk_bytes", self.chunk_bytes, "must be > 0")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            _fail("TensorManifest", "tensors", dup, "duplicate tensor names")

    def frames_per_tensor(self) -> list[int]:
        """Number of frames each tensor occupies, in manifest order."""
        return [max(1, -(-t.nbytes // self.chunk_bytes)) for t in self.tensors]

    @property
    def num_frames(self) -> int:
        return sum(self.frames_per_tensor())

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


# --------------------------------------------------------------------------- weights (parameter server)

Metadata = dict[str, Any]


class PushBegin(Message, frozen=True):
    """Start pushing weight `version`; the server answers `PushReady` or an error
    (``stale_version`` when `version` is not newer than the latest). With `local` the
    pusher can write the server's files (the same host): a server that persists its
    versions then names a staging file in `PushReady` to write the tensors into instead
    of sending frames."""

    version: int
    manifest: TensorManifest
    metadata: Metadata = {}
    local: bool = False


class PushReady(Message, frozen=True):
    """With `staging_file`, write tensor i of the manifest at byte `data_offset` plus its
    64-byte-aligned offset into that file (created by the server, header written), then
    `PushCommit`; no `PushChunks`. A pusher that cannot open the file (another host)
    sends `PushAbort` and pushes again without `local`."""

    push_id: int
    max_message_bytes: int
    staging_file: str = ""
    data_offset: int = 0


class PushChunks(Message, frozen=True):
    """Followed by `count` raw frames: frames ``first_frame .. first_frame+count-1`` of the manifest."""

    push_id: int
    first_frame: int
    count: int


class PushCommit(Message, frozen=True):
    """Make the pushed version visible; succeeds only if every frame arrived intact."""

    push_id: int


class PushAbort(Message, frozen=True):
    push_id: int


class Committed(Message, frozen=True):
    version: int
    persisted: bool


class PullBegin(Message, frozen=True):
    """Lease a version for pulling: `version` None means the latest. With `if_newer_than`
    the server answers `NotNewer` instead when its version is not newer. With
    `prefetch_bytes` > 0 the grant already carries the first frames (at least one, about
    that many bytes), saving a round trip. With `local` the client can read the server's
    files (the same host): the grant names the version's state file, if it has one,
    instead of carrying frames; the client maps the file and ends the lease, or fetches
    the frames as usual if it cannot use the file."""

    version: int | None = None
    if_newer_than: int | None = None
    prefetch_bytes: int = 0
    local: bool = False


class PullGranted(Message, frozen=True):
    """Followed by `first_frames` raw frames (frames ``0 .. first_frames-1``). The lease ends
    by itself once every frame was sent, or with `PullEnd`, or after `lease_ttl_s` idle."""

    lease_id: int
    version: int
    manifest: TensorManifest
    metadata: Metadata
    lease_ttl_s: float
    first_frames: int = 0
    state_file: str = ""


class NotNewer(Message, frozen=True):
    latest: int | None


class FetchChunks(Message, frozen=True):
    """Ask for frames ``first_frame .. first_frame+count-1`` of a leased version; renews the
    lease (which ends once every frame of the version was sent under it)."""

    lease_id: int
    first_frame: int
    count: int


class Chunks(Message, frozen=True):
    """Followed by `count` raw frames starting at `first_frame`."""

    lease_id: int
    first_frame: int
    count: int


class PullEnd(Message, frozen=True):
    lease_id: int


class LatestQuery(Message, frozen=True):
    pass


class WaitNewer(Message, frozen=True):
    """Long-poll: answered with `LatestVersion` once a version newer than `version`
    commits, or when `timeout_ms` runs out (then with the unchanged latest)."""

    version: int | None
    timeout_ms: int


class LatestVersion(Message, frozen=True):
    version: int | None


class StatQuery(Message, frozen=True):
    pass


class ServerStats(Message, frozen=True):
    versions: tuple[int, ...]
    latest: int | None
    bytes_held: int
    clients: int
    pulls_in_flight: int
    leases_by_version: dict[int, int]
    pending_pushes: int
    malformed_messages: int
    persisted_version: int | None
    state_error: str | None
    waiters: int = 0


# --------------------------------------------------------------------------- generation


def _check_mask(struct: str, field: str, mask: tuple[int, ...], num_tokens: int) -> None:
    if mask and len(mask) != num_tokens:
        _fail(struct, field, f"<{len(mask)} values>", f"needs none or one per token ({num_tokens})")
    if any(m != 0 and m != 1 for m in mask):
        _fail(struct, field, "<values>", "must hold only 0 and 1")


class SamplingParams(Message, frozen=True):
    """How to sample: `top_k` 0 and `top_p` 1.0 disable those filters; `temperature` 0 is greedy;
    `top_logprobs` > 0 returns that many alternatives per token."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            _fail("SamplingParams", "max_tokens", self.max_tokens, "must be > 0")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            _fail("SamplingParams", "temperature", self.temperature, "must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            _fail("SamplingParams", "top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            _fail("SamplingParams", "top_k", self.top_k, "must be >= 0 (0 disables)")
        if self.top_logprobs < 0:
            _fail("SamplingParams", "top_logprobs", self.top_logprobs, "must be >= 0")


class AgentSpec(Message, frozen=True):
    """Make each sample a multi-turn trajectory: after a model turn the worker runs
    environment `environment` (a registered `rlax_data.envs` name) on it, appends the
    environment's turn and generates the next model turn, until the environment is done or
    a limit is hit. `record`: the prompt's record as JSON (the environment's `reset` input);
    `max_turns`: model turns per trajectory; `max_total_tokens`: tokens after the prompt
    (model and environment turns together); `tool_timeout_s`: the limit of one environment
    step (its tool calls)."""

    environment: str
    record: str = ""
    max_turns: int = 4
    max_total_tokens: int = 256
    tool_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.environment:
            _fail("AgentSpec", "environment", self.environment, "must name a registered environment")
        for name in ("max_turns", "max_total_tokens"):
            if getattr(self, name) < 1:
                _fail("AgentSpec", name, getattr(self, name), "must be >= 1")
        if not (math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0):
            _fail("AgentSpec", "tool_timeout_s", self.tool_timeout_s, "must be a finite number > 0")


class GenerateRequest(Message, frozen=True):
    """Generate `n` samples continuing `prompt_token_ids`. `weight_version`: generate with
    exactly this version of the weights (the controller's pinned versions); None: with
    whichever the worker holds. `agent`: make every sample a multi-turn trajectory, all of
    its turns generated with one version (`Sample.model_mask` tells its turns apart)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    n: int = 1
    weight_version: int | None = None
    agent: AgentSpec | None = None

    def __post_init__(self) -> None:
        if self.n <= 0:
            _fail("GenerateRequest", "n", self.n, "must be > 0")
        if self.weight_version is not None and self.weight_version < 0:
            _fail("GenerateRequest", "weight_version", self.weight_version, "must be >= 0")
        if not self.prompt_token_ids:
            _fail("GenerateRequest", "prompt_token_ids", self.prompt_token_ids, "must not be empty")


TrajectoryEnd = Literal["", "answer", "max_turns", "max_tokens", "abort", "error"]
"""Why a trajectory ended; ``error``: its environment raised, overran or was refused (the
worker's agent loop counts the kind in `tool_errors`)."""


class Sample(Message, frozen=True):
    """One generated continuation: `logprobs[t]` is the sampling policy's log-probability of
    `token_ids[t]`; `top_logprobs[t]` maps alternative token ids to their log-probabilities.

    A multi-turn trajectory (`GenerateRequest.agent`) holds every turn after the prompt:
    `model_mask[t]` is 1 for a token the model sampled (trained, with its logprob) and 0 for
    an environment token (context only; its logprob is 0); empty means every token is the
    model's. `turns`: model turns; `tool_calls` / `tool_errors`: environment steps that ran
    a tool / whose tool call failed (malformed, unknown tool, crash, timeout, too large);
    `end`: why the trajectory ended (`answer`: the environment was done; `error`: the
    environment failed); `env_reward`: the
    environment's own reward, when it gives one (else the run's verifier scores)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    top_logprobs: tuple[dict[int, float], ...] = ()
    model_mask: tuple[int, ...] = ()
    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    end: TrajectoryEnd = ""
    env_reward: float | None = None

    def __post_init__(self) -> None:
        _check_mask("Sample", "model_mask", self.model_mask, len(self.token_ids))
        for name in ("turns", "tool_calls", "tool_errors"):
            if getattr(self, name) < 0:
                _fail("Sample", name, getattr(self, name), "must be >= 0")
        if self.env_reward is not None and not math.isfinite(self.env_reward):
            _fail("Sample", "env_reward", self.env_reward, "must be finite")
        for name, values in (("logprobs", self.logprobs), ("top_logprobs", self.top_logprobs)):
            if values and len(values) != len(self.token_ids):
                _fail(
                    "Sample",
                    name,
                    f"<{len(values)} values>",
                    f"needs none or one per token ({len(self.token_ids)})",
                )


class WorkerStats(Message, frozen=True):
    """A worker's running totals since it started; the controller differences two of them.

    `active_s`: wall seconds with at least one unfinished request (generation as a run sees
    it: engine steps plus the worker's own loop, socket and version checks; weight loads
    and compilation are counted apart, in `reload_s` and `compile_s`); `engine_s`: seconds
    inside engine steps; `compile_s`: start-up compilation of the shapes the run will use,
    and engine steps that compiled a new one; `reload_s`: pulling and installing weights.
    `shared_weight_bytes` (a reading, not a total): bytes of the loaded weights that are
    the parameter server's state file mapped on this host, shared with every process that
    maps it, rather than a copy of the worker's own."""

    generated_tokens: int = 0
    active_s: float = 0.0
    engine_s: float = 0.0
    compile_s: float = 0.0
    reload_s: float = 0.0
    reloads: int = 0
    shared_weight_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("generated_tokens", "reloads", "shared_weight_bytes"):
            if getattr(self, name) < 0:
                _fail("WorkerStats", name, getattr(self, name), "must be >= 0")
        for name in ("active_s", "engine_s", "compile_s", "reload_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                _fail("WorkerStats", name, value, "must be a finite number >= 0")


class GenerateResult(Message, frozen=True):
    """All samples of one request, generated by exactly one weight version; `stats`: the
    worker's totals when it sent this result (optional)."""

    request_id: str
    samples: tuple[Sample, ...]
    weight_version: int
    stats: WorkerStats | None = None


class Rollout(Message, frozen=True):
    """One scored (or to-be-scored) sample of group `group_index` of prompt `prompt_id`.
    `completion_mask`: `Sample.model_mask` (1: trained, 0: an environment token; empty: all 1)."""

    prompt_id: str
    group_index: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    worker_logprobs: tuple[float, ...]
    policy_version: int
    finish_reason: FinishReason = "stop"
    reward: float | None = None
    completion_mask: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_mask("Rollout", "completion_mask", self.completion_mask, len(self.completion_token_ids))
        if len(self.worker_logprobs) != len(self.completion_token_ids):
            _fail(
                "Rollout",
                "worker_logprobs",
                f"<{len(self.worker_logprobs)} values>",
                f"needs one per completion token ({len(self.completion_token_ids)})",
            )


# --------------------------------------------------------------------------- verification


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
            _fail("VerifyRequest", "timeout_s", self.timeout_s, "must be a finite number > 0")


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
            _fail("EnvStepRequest", "environment", self.environment, "must name an environment")
        if not 1 <= len(self.turns) <= MAX_ENV_TURNS:
            _fail("EnvStepRequest", "turns", f"<{len(self.turns)} turns>", f"needs 1 to {MAX_ENV_TURNS}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            _fail("EnvStepRequest", "timeout_s", self.timeout_s, "must be a finite number > 0")


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

    def __post_init__(self) -> None:
        for name in ("tool_calls", "tool_errors"):
            if getattr(self, name) < 0:
                _fail("EnvStepResult", name, getattr(self, name), "must be >= 0")
        if self.reward is not None and not math.isfinite(self.reward):
            _fail("EnvStepResult", "reward", self.reward, "must be finite")


AnyMessage = Union[  # noqa: UP007 - msgspec needs a runtime Union object here
    Hello,
    Welcome,
    ErrorReply,
    Ack,
    TensorHeader,
    TensorManifest,
    PushBegin,
    PushReady,
    PushChunks,
    PushCommit,
    PushAbort,
    Committed,
    PullBegin,
    PullGranted,
    NotNewer,
    FetchChunks,
    Chunks,
    PullEnd,
    LatestQuery,
    WaitNewer,
    LatestVersion,
    StatQuery,
    ServerStats,
    SamplingParams,
    AgentSpec,
    GenerateRequest,
    Sample,
    WorkerStats,
    GenerateResult,
    Rollout,
    VerifyRequest,
    VerifyResult,
    VerifyBatch,
    VerifyBatchResult,
    EnvStepRequest,
    EnvStepResult,
]

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(AnyMessage)

M = TypeVar("M", bound=Message)


def encode(message: Message) -> bytes:
    """msgpack bytes of `message` (its tag included)."""
    return _encoder.encode(message)


def decode(
    data: bytes | memoryview | bytearray,
    *,
    max_depth: int = MAX_MESSAGE_DEPTH,
    max_bytes: int = MAX_MESSAGE_BYTES,
) -> Message:
    """Decode any RLAX message; never raises anything but `MalformedMessageError`.

    The bytes are first checked (iteratively) for nesting deeper than `max_depth`, a
    size above `max_bytes` and impossible declared lengths, because msgspec recurses
    into nested values and would otherwise exhaust the stack (`RecursionError`) or try
    to allocate what a hostile length prefix claims.
    """
    check_msgpack_bounds(data, max_depth=max_depth, max_bytes=max_bytes)
    try:
        message: Message = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise MalformedMessageError(f"cannot decode message ({len(data)} bytes): {err}") from None
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as err:
        # Defence in depth: the bounds above should make these unreachable.
        raise MalformedMessageError(
            f"cannot decode message ({len(data)} bytes): {type(err).__name__}: {err}"
        ) from None
    return message


def decode_as(data: bytes | memoryview | bytearray, expected: type[M] | tuple[type[M], ...]) -> M:
    """Decode and require one of the `expected` types, else `MalformedMessageError` naming both."""
    message = decode(data)
    if not isinstance(message, expected):
        names = expected.__name__ if isinstance(expected, type) else " or ".join(t.__name__ for t in expected)
        raise MalformedMessageError(f"expected {names}, got {type(message).__name__}")
    return message
