"""The agent loop: multi-turn, tool-calling trajectories generated next to the engine.

A `GenerateRequest` with an `agent` spec makes each of its `n` samples a trajectory:

    prompt | model turn 1 | environment turn 1 | model turn 2 | ... | model turn T

The first model turn of all `n` samples is one engine request (they share the prompt's
prefill, as single-turn samples do). When a sample's turn ends (a stop string such as the
tool format's `]` or `</tool_call>`, end of sequence, or its token budget), the
environment's `step` runs on the turn's text in a thread of its own, so a slow tool never
holds up the engine, which goes on stepping every other sequence. The same thread turns the
observation into token ids, after checking its length against the tokens left for it (a
10 MB observation is refused from its length alone, never tokenized). The observation is
appended as environment tokens (mask 0, logprob 0) and the next model turn is a new engine request
continuing the whole trajectory: the blocks of everything before it are found in the
prefix cache (the engine keys a finished sequence's blocks), so only the environment's
tokens are prefilled.

Every turn of a trajectory is generated with the weights loaded when it started: the worker
loads no other version while a trajectory is in flight. Turn t > 0 of sample i draws with
the seed `turn_seed(seed, i, t)` (sample index 0 of its own request), so a trajectory is a
function of the request, the weights and the environment: regenerated after a kill, it
comes out the same.

Every model turn's reward is recorded with the turn (`Sample.turn_ends`, `turn_rewards`):
the reward of the environment step that answered it (0.0 where the step gave none, or
none ran). `Sample.env_reward` is the last step's reward alone; when that step gave none
the run's verifier scores the final answer, and the controller pays its score to the last
turn. No reward overwrites another's.

Whether a trajectory used its tools correctly is its environment's verdict
(`EnvStep.tool_correct`, optional): the last step's that is not None goes to
`Sample.tool_correct` (None when no step judged: the environment cannot tell).

Limits end a trajectory with a reason (`Sample.end`): `answer` (the environment is done),
`max_turns`, `max_tokens` (`max_total_tokens` after the prompt, or the model's context, an
observation larger than the tokens left included), `error` (the environment raised, or its
step overran `2 * tool_timeout_s`: tools are bounded by their own limits first) and `abort`
(the engine aborted a turn).

Every failure of an environment step counts in the trajectory's `tool_errors` and, by
kind, in `AgentLoop.tool_error_counts`: the environment's own `EnvStep.error` kinds
(`malformed`, `timeout`, `too_large`, ...) and the loop's: `step_timeout` (the step
overran and was abandoned), `step_crash` (the environment raised), `step_refused` (too many
abandoned steps still run), `too_large` (the observation did not fit in the tokens left)
and `bad_observation` (the engine refused its tokens).

A step that overruns is abandoned and its thread slot goes to the next step at once
(`rlax_core.deadline_threads`): Python cannot kill a thread, so the hung thread is
interrupted (which ends a step that runs Python code) and counted, and the worker keeps its
full `env_threads` for other trajectories. Environments are not run in a subprocess that
could be killed: they are user objects holding a trajectory's state, made by factories in
this process, and a JAX process cannot fork; `agent.where: service` moves them out of the
worker, and the Python tool's programs already run in a sandbox that its deadline kills.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import rlax_protocol as rp
from rlax_core.deadline_threads import DeadlineThreads, Overloaded
from rlax_inference.engine import CompletionOutput, LLMEngine, RequestOutput
from rlax_inference.sequence import FinishReason, SamplingParams

__all__ = ["AgentLoop", "TurnCodec", "turn_seed"]

log = logging.getLogger("rlax.worker.agent")


AgentResult = tuple[int, rp.GenerateRequest, list[rp.Sample], int | None]
"""A finished request: its worker key, the request, its samples, the weight version."""

# Characters one token may stand for, for a codec that does not say (`TurnCodec.max_token_chars`).
_DEFAULT_MAX_TOKEN_CHARS = 64
# An observation longer than this many characters per token left is first measured on
# prefixes (this long, then twice as long, ...): typical text has 3-5 characters per
# token, so a flood is refused after tokenizing a few times the room's worth of it, not
# all of it (the tokenizer holds the interpreter lock while it works).
_PROBE_CHARS_PER_TOKEN = 4
_PROBE_MIN_CHARS = 256
_PROBE_SLACK_TOKENS = 16  # the prefix's last word may be cut into more tokens than whole
# Distinct error kinds counted (then "other"), and the longest kind name kept.
_MAX_ERROR_KINDS = 64
_MAX_ERROR_KIND_CHARS = 40


class TurnCodec(Protocol):
    """What the loop needs from the run's task (`rlax_data.task_from_config.AgentTurns`)."""

    def new_environment(self, name: str, record_json: str) -> Any:
        """A fresh environment `name` for one trajectory, already `reset` with the record
        (ValueError for an unknown name or a record that does not parse)."""
        ...

    def turn_text(self, token_ids: list[int]) -> str:
        """The text of one model turn (what the environment parses)."""
        ...

    def env_turn_ids(self, observation: str, *, after_end_of_turn: bool) -> list[int]:
        """Token ids of an environment turn that follows a model turn (which ended with the
        end-of-turn token when `after_end_of_turn`), ready for the next model turn. The
        observation is text, never special tokens. Called in environment threads.

        A codec may also say `max_token_chars: int`, the most characters one token of an
        observation stands for (64 when it does not): an observation longer than the tokens
        left times that is refused without tokenizing it."""
        ...

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Stop strings that end a model turn holding a tool call."""
        ...


def turn_seed(seed: int, sample_index: int, turn: int) -> int:
    """The seed of turn `turn` (>= 1) of sample `sample_index` of a request seeded `seed`."""
    digest = hashlib.blake2b(f"{seed}/{sample_index}/{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclasses.dataclass
class _Trajectory:
    index: int
    env: Any
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    # Per model turn with tokens: the index of its last token in `tokens`, and its reward.
    turn_ends: list[int] = dataclasses.field(default_factory=list)
    turn_rewards: list[float] = dataclasses.field(default_factory=list)
    env_reward: float | None = None  # the reward of the step answering the latest model turn
    tool_correct: bool | None = None  # the environment's latest verdict on the tool use
    end: str = ""
    finish_reason: str = "stop"
    ended_with_stop_token: bool = False
    step_future: Future[_StepOutcome] | None = None


@dataclasses.dataclass(frozen=True)
class _StepOutcome:
    """An environment step, read in its thread (the environment's values are plain here),
    and, when another model turn may follow, its observation's ids: None when none may
    follow (`room` < 1) or when the observation does not fit in `room` (`too_large`)."""

    done: bool
    reward: float | None
    tool_calls: int
    tool_errors: int
    error: str
    tool_correct: bool | None
    room: int
    chars: int = 0
    observation_ids: list[int] | None = None
    too_large: bool = False


@dataclasses.dataclass
class _AgentRequest:
    key: int
    request: rp.GenerateRequest
    params: SamplingParams
    trajectories: list[_Trajectory]
    version: int | None = None

    @property
    def done(self) -> bool:
        return all(t.end for t in self.trajectories)


class AgentLoop:
    """The worker's multi-turn requests: `start` one, feed it the engine's outputs
    (`on_output`), let it collect environment steps (`poll`); both return the results of
    requests whose every trajectory ended, as (key, request, samples, weight version or None)."""

    def __init__(
        self,
        engine: Callable[[], LLMEngine],
        codec: TurnCodec,
        *,
        max_model_len: int,
        env_threads: int = 8,
        max_abandoned_steps: int = 256,
    ) -> None:
        self._engine = engine
        self.codec = codec
        self.max_model_len = max_model_len
        self._threads = DeadlineThreads(env_threads, max_abandoned=max_abandoned_steps, name="rlax-env")
        self.tool_error_counts: collections.Counter[str] = collections.Counter()
        """Failed environment steps by kind, since the loop started (see the module docstring)."""
        self._requests: dict[int, _AgentRequest] = {}
        self._turns: dict[str, tuple[int, int]] = {}  # engine request id -> (key, sample index)

    # -- state ---------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """A trajectory is in flight: its next turns need the loaded weights."""
        return bool(self._requests)

    @property
    def waiting_on_environment(self) -> bool:
        return any(t.step_future is not None for r in self._requests.values() for t in r.trajectories)

    @property
    def serving_unpinned(self) -> bool:
        """A request in flight names no weight version (it follows the newest)."""
        return any(r.request.weight_version is None for r in self._requests.values())

    @property
    def abandoned_steps(self) -> int:
        """Environment steps that overran and whose threads still run."""
        return self._threads.abandoned

    def owns(self, engine_request_id: str) -> bool:
        return engine_request_id in self._turns

    def close(self) -> None:
        self._threads.close()

    # -- requests ------------------------------------------------------------------------
    def start(self, key: int, request: rp.GenerateRequest, params: SamplingParams) -> None:
        """Make the request's environments and queue its first turn (ValueError if refused)."""
        spec = request.agent
        assert spec is not None
        stops = tuple(dict.fromkeys((*params.stop, *self.codec.stop_strings)))
        params = dataclasses.replace(
            params, stop=stops, max_tokens=min(params.max_tokens, spec.max_total_tokens)
        )
        envs = [self.codec.new_environment(spec.environment, spec.record) for _ in range(request.n)]
        engine_id = f"{key}"
        self._engine().add_request(engine_id, request.prompt_token_ids, params)
        self._turns[engine_id] = (key, -1)
        self._requests[key] = _AgentRequest(
            key, request, params, [_Trajectory(i, env) for i, env in enumerate(envs)]
        )

    def cancel(self, key: int) -> None:
        """The client is gone: abort its turns in the engine and forget it."""
        if self._requests.pop(key, None) is None:
            return
        engine = self._engine()
        for engine_id, (owner, _) in list(self._turns.items()):
            if owner == key:
                del self._turns[engine_id]
                engine.abort(engine_id)

    def on_output(self, output: RequestOutput) -> list[AgentResult]:
        """A turn (or the first turns of all samples) finished in the engine."""
        key, sample = self._turns.pop(output.request_id, (None, -1))
        agent = None if key is None else self._requests.get(key)
        if key is None or agent is None:
            return []
        completions = sorted(output.outputs, key=lambda c: c.sample_index)
        if output.error:
            log.error("request %s: a turn failed in the engine: %s", agent.request.request_id, output.error)
        for completion in completions:
            trajectory = agent.trajectories[completion.sample_index if sample < 0 else sample]
            if trajectory.end:
                continue
            if agent.version is None:
                agent.version = completion.weight_version
            self._after_turn(agent, trajectory, completion)
        # A failed engine request may leave a sample without output: it ends here.
        for trajectory in agent.trajectories if sample < 0 else [agent.trajectories[sample]]:
            if not trajectory.end and trajectory.step_future is None and not self._in_engine(key, trajectory):
                trajectory.end = "abort"
        return self._collect()

    def _in_engine(self, key: int, trajectory: _Trajectory) -> bool:
        return (key, trajectory.index) in self._turns.values() or (key, -1) in self._turns.values()

    def poll(self) -> list[AgentResult]:
        """Take finished environment steps and start the next turns."""
        now = time.monotonic()
        for agent in list(self._requests.values()):
            limit = 2 * agent.request.agent.tool_timeout_s  # type: ignore[union-attr]
            for trajectory in agent.trajectories:
                future = trajectory.step_future
                if future is None:
                    continue
                if not future.done():
                    # The limit runs from the step's start: one waiting for a thread waits for
                    # at most `limit` (every running step ends or is abandoned by then).
                    started = self._threads.started_at(future)
                    if started is None or now - started <= limit:
                        continue
                    self._threads.abandon(future)
                    trajectory.step_future = None
                    log.error(
                        "request %s: an environment step overran its time limit (%g s); %d abandoned",
                        agent.request.request_id, limit, self._threads.abandoned,
                    )  # fmt: skip
                    self._fail(trajectory, "step_timeout", end="error")
                    continue
                trajectory.step_future = None
                try:
                    outcome = future.result()
                except Overloaded as error:
                    log.error("request %s: %s", agent.request.request_id, error)
                    self._fail(trajectory, "step_refused", end="error")
                    continue
                except Exception:
                    log.exception("request %s: the environment raised", agent.request.request_id)
                    self._fail(trajectory, "step_crash", end="error")
                    continue
                self._after_env_step(agent, trajectory, outcome)
        return self._collect()

    def _fail(self, trajectory: _Trajectory, kind: str, *, end: str = "") -> None:
        trajectory.tool_errors += 1
        self._count(kind)
        if end:
            trajectory.end = end

    def _count(self, kind: str) -> None:
        # An environment names its own kinds: a hostile one must not grow the counter forever.
        if kind not in self.tool_error_counts and len(self.tool_error_counts) >= _MAX_ERROR_KINDS:
            kind = "other"
        self.tool_error_counts[kind] += 1

    # -- one trajectory ------------------------------------------------------------------
    def _after_turn(
        self, agent: _AgentRequest, trajectory: _Trajectory, completion: CompletionOutput
    ) -> None:
        spec = agent.request.agent
        assert spec is not None
        trajectory.turns += 1
        trajectory.env_reward = None  # until the step answering this turn gives one
        trajectory.tokens += completion.tokens
        if completion.tokens:  # only an aborted turn can be empty, and no step answers it
            trajectory.turn_ends.append(len(trajectory.tokens) - 1)
            trajectory.turn_rewards.append(0.0)
        trajectory.logprobs += completion.logprobs
        trajectory.mask += [1] * len(completion.tokens)
        trajectory.finish_reason = completion.finish_reason.wire
        trajectory.ended_with_stop_token = completion.finish_reason is FinishReason.EOS
        if completion.finish_reason is FinishReason.ABORT:
            trajectory.end = "abort"
            return
        text = self.codec.turn_text(completion.tokens)
        # Tokens left for the observation and the next model turn (none after the last turn).
        used = len(trajectory.tokens)
        prompt_len = len(agent.request.prompt_token_ids)
        room = min(spec.max_total_tokens - used, self.max_model_len - prompt_len - used)
        if trajectory.turns >= spec.max_turns:
            room = 0
        after_end = trajectory.ended_with_stop_token
        trajectory.step_future = self._threads.submit(
            lambda: self._step(trajectory.env, text, room=room, after_end_of_turn=after_end)
        )

    def _step(self, env: Any, text: str, *, room: int, after_end_of_turn: bool) -> _StepOutcome:
        """In an environment thread: the step, then its observation's token ids when another
        model turn may follow, measured before they are made (see `TurnCodec`)."""
        step = env.step(text)
        done = bool(step.done)
        reward = None if step.reward is None else float(step.reward)
        kind = str(getattr(step, "error", "") or "")[:_MAX_ERROR_KIND_CHARS]
        # Optional (an environment written before it existed has none); numpy's bools are bools.
        judged = getattr(step, "tool_correct", None)
        if judged is not None and judged not in (True, False):
            raise ValueError(f"the environment's tool_correct is {judged!r}, not True, False or None")
        counts = (int(step.tool_calls), int(step.tool_errors), kind, None if judged is None else bool(judged))
        # Checked here, not where the sample is built: a bad value fails this step, not the worker.
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"the environment's reward is {reward}, not a finite number")
        if min(counts[0], counts[1]) < 0:
            raise ValueError(f"the environment's tool_calls / tool_errors are {counts[:2]}, not >= 0")
        if done or room < 1:
            return _StepOutcome(done, reward, *counts, room)
        observation = str(step.observation)
        chars = len(observation)
        per_token = int(getattr(self.codec, "max_token_chars", _DEFAULT_MAX_TOKEN_CHARS))
        if chars > room * per_token:
            return _StepOutcome(done, reward, *counts, room, chars, too_large=True)
        # Prefixes of doubling length: a flood is refused after tokenizing a few times
        # what would have fitted, not all of it.
        probe = _PROBE_CHARS_PER_TOKEN * room + _PROBE_MIN_CHARS
        while chars > probe:
            head = self.codec.env_turn_ids(observation[:probe], after_end_of_turn=after_end_of_turn)
            if len(head) > room + _PROBE_SLACK_TOKENS:
                return _StepOutcome(done, reward, *counts, room, chars, too_large=True)
            probe *= 2
        ids = [int(t) for t in self.codec.env_turn_ids(observation, after_end_of_turn=after_end_of_turn)]
        return _StepOutcome(done, reward, *counts, room, chars, ids, too_large=len(ids) > room)

    def _after_env_step(self, agent: _AgentRequest, trajectory: _Trajectory, outcome: _StepOutcome) -> None:
        spec = agent.request.agent
        assert spec is not None
        trajectory.tool_calls += outcome.tool_calls
        # An error kind counts as a failed call even where the environment left tool_errors 0.
        trajectory.tool_errors += max(outcome.tool_errors, int(bool(outcome.error)))
        if outcome.error:
            self._count(outcome.error)
        if outcome.tool_correct is not None:
            trajectory.tool_correct = outcome.tool_correct
        if outcome.reward is not None:
            # The step answered the latest model turn, which has tokens (it was not aborted).
            trajectory.turn_rewards[-1] = outcome.reward
            trajectory.env_reward = outcome.reward
        if outcome.done:
            trajectory.end = "answer"
            return
        if trajectory.turns >= spec.max_turns:
            trajectory.end = "max_turns"
            return
        if outcome.too_large:
            log.warning(
                "request %s: an observation of %d characters does not fit in the %d tokens left",
                agent.request.request_id, outcome.chars, outcome.room,
            )  # fmt: skip
            if outcome.error:  # the step's failure is counted already (say, a cut tool result)
                trajectory.end = "max_tokens"
            else:
                self._fail(trajectory, "too_large", end="max_tokens")
            return
        observation = outcome.observation_ids
        room = outcome.room - len(observation or ())
        if observation is None or room < 1:
            trajectory.end = "max_tokens"
            return
        trajectory.tokens += observation
        trajectory.logprobs += [0.0] * len(observation)
        trajectory.mask += [0] * len(observation)
        params = agent.params
        seed = None if params.seed is None else turn_seed(params.seed, trajectory.index, trajectory.turns)
        params = dataclasses.replace(params, n=1, seed=seed, max_tokens=min(params.max_tokens, room))
        engine_id = f"{agent.key}:{trajectory.index}:{trajectory.turns}"
        try:
            self._engine().add_request(
                engine_id, [*agent.request.prompt_token_ids, *trajectory.tokens], params
            )
        except ValueError as error:  # e.g. an observation token outside the vocabulary
            log.error("request %s: cannot continue a trajectory: %s", agent.request.request_id, error)
            self._fail(trajectory, "bad_observation", end="error")
            return
        self._turns[engine_id] = (agent.key, trajectory.index)

    def _collect(self) -> list[AgentResult]:
        results = []
        for key, agent in list(self._requests.items()):
            if not agent.done:
                continue
            del self._requests[key]
            samples = [
                rp.Sample(
                    token_ids=tuple(t.tokens),
                    logprobs=tuple(t.logprobs) if agent.request.sampling.logprobs else (),
                    finish_reason=t.finish_reason,  # type: ignore[arg-type]
                    model_mask=tuple(t.mask),
                    turns=t.turns,
                    tool_calls=t.tool_calls,
                    tool_errors=t.tool_errors,
                    end=t.end,  # type: ignore[arg-type]
                    env_reward=t.env_reward,
                    turn_ends=tuple(t.turn_ends),
                    turn_rewards=tuple(t.turn_rewards),
                    tool_correct=t.tool_correct,
                )
                for t in agent.trajectories
            ]
            results.append((key, agent.request, samples, agent.version))
        return results
