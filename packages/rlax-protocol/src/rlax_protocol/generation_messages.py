"""Messages of generation: what a worker is asked to generate and what it answers."""

from __future__ import annotations

import math
from typing import Literal

from rlax_protocol.message_base import Message, reject_field

FinishReason = Literal["stop", "length", "abort"]


def _check_mask(struct: str, field: str, mask: tuple[int, ...], num_tokens: int) -> None:
    if mask and len(mask) != num_tokens:
        reject_field(struct, field, f"<{len(mask)} values>", f"needs none or one per token ({num_tokens})")
    if any(m != 0 and m != 1 for m in mask):
        reject_field(struct, field, "<values>", "must hold only 0 and 1")


def _check_turn_rewards(
    struct: str,
    ends: tuple[int, ...],
    rewards: tuple[float, ...],
    mask: tuple[int, ...],
    num_tokens: int,
) -> None:
    """`ends[k]`: the index of model turn k's last token; `rewards[k]`: its reward. One pass
    over the turns (a handful), never over the tokens."""
    if len(rewards) != len(ends):
        reject_field(
            struct, "turn_rewards", f"<{len(rewards)} values>", f"needs one per turn end ({len(ends)})"
        )
    for k, reward in enumerate(rewards):
        if not math.isfinite(reward):
            reject_field(struct, "turn_rewards", reward, f"turn {k}'s reward must be finite")
    previous = -1
    for k, end in enumerate(ends):
        if not previous < end < num_tokens:
            reject_field(
                struct,
                "turn_ends",
                end,
                f"turn {k}'s end must follow the previous turn's ({previous}) and index one of the "
                f"{num_tokens} tokens",
            )
        if mask and mask[end] != 1:
            reject_field(struct, "turn_ends", end, f"turn {k}'s end is not a model token")
        previous = end


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
            reject_field("SamplingParams", "max_tokens", self.max_tokens, "must be > 0")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            reject_field("SamplingParams", "temperature", self.temperature, "must be finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            reject_field("SamplingParams", "top_p", self.top_p, "must be in (0, 1]")
        if self.top_k < 0:
            reject_field("SamplingParams", "top_k", self.top_k, "must be >= 0 (0 disables)")
        if self.top_logprobs < 0:
            reject_field("SamplingParams", "top_logprobs", self.top_logprobs, "must be >= 0")


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
            reject_field("AgentSpec", "environment", self.environment, "must name a registered environment")
        for name in ("max_turns", "max_total_tokens"):
            if getattr(self, name) < 1:
                reject_field("AgentSpec", name, getattr(self, name), "must be >= 1")
        if not (math.isfinite(self.tool_timeout_s) and self.tool_timeout_s > 0):
            reject_field("AgentSpec", "tool_timeout_s", self.tool_timeout_s, "must be a finite number > 0")


class ResumedSample(Message, frozen=True):
    """A partial rollout to continue: sample `sample_index` of the group, whose first
    generated tokens are `token_ids` (generated earlier, maybe with older weights). Its
    next token is drawn with the key the uninterrupted sample would have used there."""

    sample_index: int
    token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.sample_index < 0:
            reject_field("ResumedSample", "sample_index", self.sample_index, "must be >= 0")
        if not self.token_ids:
            reject_field("ResumedSample", "token_ids", self.token_ids, "must not be empty")


class GenerateRequest(Message, frozen=True):
    """Generate `n` samples continuing `prompt_token_ids`. `weight_version`: generate with
    exactly this version of the weights (the controller's pinned versions); None: with
    whichever the worker holds. `agent`: make every sample a multi-turn trajectory, all of
    its turns generated with one version (`Sample.model_mask` tells its turns apart).

    `resume` (partial rollouts, `workers.on_new_version: interrupt`): continue these
    samples instead of starting new ones; `n` is their number, the answer's samples come
    in their order and hold only the new tokens, and `sampling.max_tokens` counts new
    tokens. Each continues `prompt_token_ids + token_ids` from its own place in the
    request's random stream, so a seed is required; single-turn samples only."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    n: int = 1
    weight_version: int | None = None
    agent: AgentSpec | None = None
    resume: tuple[ResumedSample, ...] = ()

    def __post_init__(self) -> None:
        if self.n <= 0:
            reject_field("GenerateRequest", "n", self.n, "must be > 0")
        if self.resume:
            self._check_resume()
        if self.weight_version is not None and self.weight_version < 0:
            reject_field("GenerateRequest", "weight_version", self.weight_version, "must be >= 0")
        if not self.prompt_token_ids:
            reject_field("GenerateRequest", "prompt_token_ids", self.prompt_token_ids, "must not be empty")

    def _check_resume(self) -> None:
        if self.n != len(self.resume):
            reject_field(
                "GenerateRequest", "n", self.n, f"must be the number of resumed samples ({len(self.resume)})"
            )
        if self.agent is not None:
            reject_field("GenerateRequest", "resume", "<samples>", "cannot continue multi-turn trajectories")
        if self.sampling.seed is None:
            reject_field(
                "GenerateRequest", "resume", "<samples>", "needs sampling.seed (the stream it continues)"
            )
        indices = [r.sample_index for r in self.resume]
        if len(set(indices)) != len(indices):
            reject_field("GenerateRequest", "resume", "<samples>", "continues a sample_index twice")


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
    environment failed); `env_reward`: the reward of the environment's last step (the one
    answering the last model turn), when it gives one (else the run's verifier scores the
    final answer). `tool_correct`: whether the trajectory used its tools correctly, as its
    environment judged (`rlax_data.envs.EnvStep.tool_correct`: for the calculator, a call
    whose result was the right answer and was then given as the final answer); None where
    the environment cannot tell (and for a single-turn sample).

    Per-turn rewards of a trajectory: `turn_ends[k]` is the index (in `token_ids`) of model
    turn k's last token and `turn_rewards[k]` the reward of the environment step answering
    it (0.0 where the step gave none, or none ran); empty for a single-turn sample. The
    last entry is `env_reward` when that is set; when it is not, the controller adds the
    verifier's score there. Two flat lists of scalars rather than a list of pairs: they
    decode in msgspec's fast path, old messages without them still decode (empty), and
    they validate in one pass over the turns."""

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
    turn_ends: tuple[int, ...] = ()
    turn_rewards: tuple[float, ...] = ()
    tool_correct: bool | None = None

    def __post_init__(self) -> None:
        _check_mask("Sample", "model_mask", self.model_mask, len(self.token_ids))
        _check_turn_rewards("Sample", self.turn_ends, self.turn_rewards, self.model_mask, len(self.token_ids))
        if len(self.turn_ends) > self.turns:
            reject_field(
                "Sample", "turn_ends", f"<{len(self.turn_ends)} values>", f"more than `turns` ({self.turns})"
            )
        if self.env_reward is not None and self.turn_rewards and self.turn_rewards[-1] != self.env_reward:
            reject_field(
                "Sample",
                "turn_rewards",
                self.turn_rewards[-1],
                f"the last turn's reward must be env_reward ({self.env_reward})",
            )
        for name in ("turns", "tool_calls", "tool_errors"):
            if getattr(self, name) < 0:
                reject_field("Sample", name, getattr(self, name), "must be >= 0")
        if self.env_reward is not None and not math.isfinite(self.env_reward):
            reject_field("Sample", "env_reward", self.env_reward, "must be finite")
        for name, values in (("logprobs", self.logprobs), ("top_logprobs", self.top_logprobs)):
            if values and len(values) != len(self.token_ids):
                reject_field(
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
                reject_field("WorkerStats", name, getattr(self, name), "must be >= 0")
        for name in ("active_s", "engine_s", "compile_s", "reload_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                reject_field("WorkerStats", name, value, "must be a finite number >= 0")


class GenerateResult(Message, frozen=True):
    """All samples of one request, generated by exactly one weight version; `stats`: the
    worker's totals when it sent this result (optional)."""

    request_id: str
    samples: tuple[Sample, ...]
    weight_version: int
    stats: WorkerStats | None = None


class Rollout(Message, frozen=True):
    """One scored (or to-be-scored) sample of group `group_index` of prompt `prompt_id`.
    `completion_mask`: `Sample.model_mask` (1: trained, 0: an environment token; empty: all 1).
    `turn_ends` / `turn_rewards`: a trajectory's per-turn rewards (as in `Sample`, indices
    into `completion_token_ids`, the verifier's score included); `reward` is then their sum.
    Empty: one reward for the whole completion, paid at its last model token.
    `token_versions`: a partial rollout's weight version per completion token (its
    segments' versions, the first being `policy_version`, the oldest); empty: every token
    is `policy_version`'s. `worker_logprobs` are each token's own version's."""

    prompt_id: str
    group_index: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    worker_logprobs: tuple[float, ...]
    policy_version: int
    finish_reason: FinishReason = "stop"
    reward: float | None = None
    completion_mask: tuple[int, ...] = ()
    turn_ends: tuple[int, ...] = ()
    turn_rewards: tuple[float, ...] = ()
    token_versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.token_versions:
            if len(self.token_versions) != len(self.completion_token_ids):
                reject_field("Rollout", "token_versions", f"<{len(self.token_versions)} values>",
                             f"needs none or one per completion token ({len(self.completion_token_ids)})")  # fmt: skip
            if min(self.token_versions) != self.policy_version:
                reject_field("Rollout", "token_versions", min(self.token_versions),
                             f"the oldest must be policy_version ({self.policy_version})")  # fmt: skip
        _check_mask("Rollout", "completion_mask", self.completion_mask, len(self.completion_token_ids))
        _check_turn_rewards(
            "Rollout",
            self.turn_ends,
            self.turn_rewards,
            self.completion_mask,
            len(self.completion_token_ids),
        )
        if self.turn_rewards and self.reward is not None:
            total = math.fsum(self.turn_rewards)
            if not math.isclose(self.reward, total, rel_tol=1e-9, abs_tol=1e-12):
                reject_field("Rollout", "reward", self.reward, f"must be the sum of turn_rewards ({total})")
        if len(self.worker_logprobs) != len(self.completion_token_ids):
            reject_field(
                "Rollout",
                "worker_logprobs",
                f"<{len(self.worker_logprobs)} values>",
                f"needs one per completion token ({len(self.completion_token_ids)})",
            )
