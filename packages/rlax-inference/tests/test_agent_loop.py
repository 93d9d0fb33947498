"""The agent loop on the tiny model: trajectories, their masks and logprobs, prefix reuse
across turns, determinism, limits, and environments that hang or raise.

The environment here is scripted (a user-written environment, as `rlax_data.envs` users
write them) so that every observation and every turn boundary is known in advance; the
run's real environments and tokenizers are exercised in `tests/test_multiturn.py`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pytest
from tiny_model import CONFIG, PARAMS, teacher_forced_logprobs

import rlax_protocol as rp
from rlax_inference.agent_loop import AgentLoop, turn_seed
from rlax_inference.engine import EngineConfig, LLMEngine
from rlax_inference.sequence import SamplingParams

BLOCK = 8
TURN_TOKENS = 6
OBSERVATIONS = ([11, 12, 13], [14, 15])  # environment turns 1 and 2; done after the third model turn


@dataclass
class Step:
    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 1
    tool_errors: int = 0


class ScriptedEnv:
    """Answers each model turn with the next scripted observation; done after them all."""

    name = "scripted"

    def __init__(self, observations=OBSERVATIONS, *, hang: threading.Event | None = None, fail: bool = False):
        self.observations = list(observations)
        self.turns_seen: list[str] = []
        self.hang = hang
        self.fail = fail

    def reset(self, record):
        return ""

    def step(self, model_turn: str) -> Step:
        self.turns_seen.append(model_turn)
        if self.hang is not None:
            self.hang.wait()
        if self.fail:
            raise RuntimeError("the environment broke")
        if len(self.turns_seen) > len(self.observations):
            return Step("", done=True, reward=0.5, tool_calls=0)
        return Step(",".join(map(str, self.observations[len(self.turns_seen) - 1])), done=False)


class IdCodec:
    """Turn text = the token ids joined by commas; an observation is such a list."""

    stop_strings: tuple[str, ...] = ()

    def __init__(self, make_env=ScriptedEnv):
        self.make_env = make_env
        self.envs: list[ScriptedEnv] = []

    def new_environment(self, name, record_json):
        if name != "scripted":
            raise ValueError(f"unknown environment {name!r}")
        env = self.make_env()
        self.envs.append(env)
        return env

    def turn_text(self, token_ids):
        return ",".join(map(str, token_ids))

    def env_turn_ids(self, observation, *, after_end_of_turn):
        return [int(t) for t in observation.split(",")]


def make_engine(**kw) -> LLMEngine:
    cfg = dict(block_size=BLOCK, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=128,
               max_model_len=128, eos_token_ids=())  # fmt: skip
    cfg.update(kw)
    return LLMEngine(CONFIG, PARAMS, EngineConfig(**cfg))


def request(prompt, *, n=2, seed=7, max_turns=3, max_total_tokens=100, timeout=5.0, request_id="r"):
    spec = rp.AgentSpec(
        environment="scripted", record="{}", max_turns=max_turns,
        max_total_tokens=max_total_tokens, tool_timeout_s=timeout,
    )  # fmt: skip
    sampling = rp.SamplingParams(max_tokens=TURN_TOKENS, temperature=1.0, seed=seed)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=TURN_TOKENS, seed=seed)
    return rp.GenerateRequest(request_id=request_id, prompt_token_ids=tuple(prompt), sampling=sampling,
                              n=n, agent=spec), params  # fmt: skip


def drive(engine, loop, *, extra=None):
    """Step the engine and the loop until every agent request finished; `extra`: single-turn
    outputs are collected there."""
    results = []
    for _ in range(10_000):
        if engine.has_unfinished:
            for output in engine.step():
                if loop.owns(output.request_id):
                    results += loop.on_output(output)
                elif extra is not None:
                    extra.append(output)
        results += loop.poll()
        if not loop.active and not engine.has_unfinished:
            return results
        if not engine.has_unfinished:
            threading.Event().wait(0.002)
    raise AssertionError("the loop did not finish")


def prompt_of(length, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(3, CONFIG.vocab_size, size=length)]


def test_trajectory_mask_logprobs_and_prefix_reuse_are_exact():
    prompt = prompt_of(20)
    engine = make_engine()
    codec = IdCodec()
    loop = AgentLoop(lambda: engine, codec, max_model_len=128)
    req, params = request(prompt)
    loop.start(0, req, params)
    [(key, got_request, samples, version)] = drive(engine, loop)
    assert key == 0 and got_request is req and version == 0  # the engine starts at version 0
    # Hand-built: model turn (6), environment [11 12 13], model turn (6), environment [14 15], model turn (6).
    expected_mask = [1] * 6 + [0] * 3 + [1] * 6 + [0] * 2 + [1] * 6
    for sample, env in zip(samples, codec.envs, strict=True):
        assert list(sample.model_mask) == expected_mask
        tokens = list(sample.token_ids)
        assert tokens[6:9] == [11, 12, 13] and tokens[15:17] == [14, 15]
        assert sample.turns == 3 and sample.tool_calls == 2 and sample.end == "answer"
        assert sample.env_reward == 0.5 and sample.finish_reason == "length"
        # The environment saw exactly the model's turns.
        assert env.turns_seen == [",".join(map(str, tokens[a:b])) for a, b in ((0, 6), (9, 15), (17, 23))]
        # Behaviour logprobs of the model's tokens = a teacher-forced pass over the whole trajectory.
        reference = teacher_forced_logprobs(PARAMS, prompt, tokens)
        model = np.array(expected_mask, bool)
        np.testing.assert_allclose(np.array(sample.logprobs)[model], reference[model], atol=1e-5, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(sample.logprobs, expected_mask, strict=True) if not m)
    assert samples[0].token_ids != samples[1].token_ids
    # Prefix reuse, counted in tokens. Turn 2 of a sample continues 20 + 6 + 3 = 29 tokens; its
    # first turn computed 25 of them (all but the last sampled token), all served from the cache:
    # 3 full blocks and the partial fourth (1 token, copied into a fresh block). Turn 3 continues
    # 29 + 6 + 2 = 37 tokens, 34 computed: 4 blocks and 2 tokens of the fifth.
    assert engine.num_prefix_cache_hit_tokens == 2 * (25 + 34)
    # Computed: the prompt once (both samples share it), then the tokens no turn had computed.
    assert engine.num_computed_prefill_tokens == 20 + 2 * (29 - 25) + 2 * (37 - 34)


def test_trajectories_do_not_depend_on_what_else_runs():
    prompt = prompt_of(13, seed=1)
    alone_engine = make_engine()
    alone = AgentLoop(lambda: alone_engine, IdCodec(), max_model_len=128)
    req, params = request(prompt, n=3, seed=11)
    alone.start(0, req, params)
    [(_, _, reference, _)] = drive(alone_engine, alone)

    busy_engine = make_engine()
    busy = AgentLoop(lambda: busy_engine, IdCodec(), max_model_len=128)
    busy_engine.add_request("other", prompt_of(30, seed=2), SamplingParams(n=4, max_tokens=40, seed=3))
    other_req, other_params = request(prompt_of(9, seed=3), n=2, seed=5, request_id="o")
    busy.start(1, other_req, other_params)
    busy.start(0, req, params)
    extra: list = []
    results = {key: samples for key, _, samples, _ in drive(busy_engine, busy, extra=extra)}
    assert [s.token_ids for s in results[0]] == [s.token_ids for s in reference]
    np.testing.assert_allclose(
        [lp for s in results[0] for lp in s.logprobs], [lp for s in reference for lp in s.logprobs], atol=1e-5
    )
    assert len(extra) == 1 and len(extra[0].outputs[0].tokens) == 40


def test_turn_seeds_differ_by_sample_and_turn():
    seeds = {turn_seed(7, i, t) for i in range(8) for t in range(1, 8)}
    assert len(seeds) == 56 and all(0 <= s < 2**32 for s in seeds)
    assert turn_seed(7, 0, 1) == turn_seed(7, 0, 1) != turn_seed(8, 0, 1)


@pytest.mark.parametrize(
    ("max_turns", "max_total_tokens", "end", "turns", "length"),
    [
        (2, 100, "max_turns", 2, 6 + 3 + 6),  # the second turn's observation is not appended
        (3, 14, "max_tokens", 2, 6 + 3 + 5),  # the second turn gets only the 5 tokens left
        (3, 10, "max_tokens", 2, 6 + 3 + 1),
    ],
)
def test_limits_end_a_trajectory_with_their_reason(max_turns, max_total_tokens, end, turns, length):
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(), max_model_len=128)
    req, params = request(prompt_of(10), n=1, max_turns=max_turns, max_total_tokens=max_total_tokens)
    loop.start(0, req, params)
    [(_, _, [sample], _)] = drive(engine, loop)
    assert (sample.end, sample.turns, len(sample.token_ids)) == (end, turns, length)
    assert len(sample.token_ids) <= max_total_tokens
    assert engine.num_free_blocks == 64  # every block went back (cached or free)


def test_a_hanging_environment_ends_its_trajectory_and_the_engine_keeps_going():
    release = threading.Event()
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(lambda: ScriptedEnv(hang=release)), max_model_len=128)
    try:
        req, params = request(prompt_of(12), n=2, timeout=0.05)
        loop.start(0, req, params)
        engine.add_request("single", prompt_of(20, seed=4), SamplingParams(n=1, max_tokens=30, seed=1))
        extra: list = []
        [(_, _, samples, _)] = drive(engine, loop, extra=extra)
        assert [s.end for s in samples] == ["error", "error"]
        assert [s.turns for s in samples] == [1, 1]
        assert len(extra) == 1 and len(extra[0].outputs[0].tokens) == 30
    finally:
        release.set()
        loop.close()


def test_an_environment_that_raises_ends_its_trajectory_and_counts():
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(lambda: ScriptedEnv(fail=True)), max_model_len=128)
    req, params = request(prompt_of(12), n=2)
    loop.start(0, req, params)
    [(_, _, samples, _)] = drive(engine, loop)
    assert [s.end for s in samples] == ["error", "error"]
    assert all(sum(s.model_mask) == len(s.token_ids) == TURN_TOKENS for s in samples)
    assert [s.tool_errors for s in samples] == [1, 1] and loop.tool_error_counts == {"step_crash": 2}


def test_cancel_mid_trajectory_aborts_its_turns_and_frees_blocks():
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(), max_model_len=128)
    req, params = request(prompt_of(12), n=2)
    loop.start(0, req, params)
    while not loop.waiting_on_environment:
        for output in engine.step():
            loop.on_output(output)
    loop.poll()
    loop.cancel(0)
    assert not loop.active
    while engine.has_unfinished:
        engine.step()
    assert engine.num_free_blocks == 64


def test_an_unknown_environment_is_refused_before_anything_runs():
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(), max_model_len=128)
    req, params = request(prompt_of(12))
    bad = rp.GenerateRequest(
        request_id="r", prompt_token_ids=req.prompt_token_ids, sampling=req.sampling, n=2,
        agent=rp.AgentSpec(environment="nope"),
    )  # fmt: skip
    with pytest.raises(ValueError, match="nope"):
        loop.start(0, bad, params)
    assert not loop.active and not engine.has_unfinished


# -- hostile environments (issue 29) ------------------------------------------------------


def test_twenty_hung_steps_do_not_take_the_threads_of_later_trajectories():
    # Eight fixed threads used to stay blocked in hung steps: after 8 of them every later
    # trajectory, even with an instant environment, ended `error`.
    release = threading.Event()
    engine = make_engine(max_num_seqs=32, num_blocks=256)
    hanging = IdCodec(lambda: ScriptedEnv(hang=release))
    loop = AgentLoop(lambda: engine, hanging, max_model_len=128, env_threads=8)
    try:
        req, params = request(prompt_of(12), n=20, timeout=0.02, request_id="hung")
        loop.start(0, req, params)
        [(_, _, samples, _)] = drive(engine, loop)
        assert [s.end for s in samples] == ["error"] * 20
        # An instant environment on the same loop: its trajectories run to their answer.
        hanging.make_env = ScriptedEnv
        req, params = request(prompt_of(12, seed=5), n=4, timeout=0.02, request_id="instant")
        loop.start(1, req, params)
        [(_, _, instant, _)] = drive(engine, loop)
        assert [s.end for s in instant] == ["answer"] * 4
        assert all(s.turns == 3 and s.tool_errors == 0 for s in instant)
        # The hung steps are counted, and their threads (blocked in a C wait, which the
        # interrupt cannot reach) are abandoned, not waited for.
        assert all(s.tool_errors == 1 for s in samples)
        assert loop.tool_error_counts == {"step_timeout": 20}
        assert loop.abandoned_steps == 20
    finally:
        release.set()
        loop.close()


class SpyCodec(IdCodec):
    """IdCodec that records the length of every observation it is asked to encode."""

    max_token_chars = 10  # a bound, as a BPE tokenizer's longest token is (this codec needs 3)

    def __init__(self, make_env):
        super().__init__(make_env)
        self.encoded: list[int] = []

    def env_turn_ids(self, observation, *, after_end_of_turn):
        self.encoded.append(len(observation))
        return [int(t) for t in observation.split(",") if t]


def test_a_ten_megabyte_observation_is_refused_from_its_length_and_counted():
    flood = "1," * 5_000_000  # 10 MB, 5M tokens
    engine = make_engine()
    codec = SpyCodec(lambda: ScriptedEnv(observations=([0],)))
    codec.make_env = lambda: FloodEnv(flood)
    loop = AgentLoop(lambda: engine, codec, max_model_len=128)
    req, params = request(prompt_of(10), n=1, max_total_tokens=100)
    loop.start(0, req, params)
    [(_, _, [sample], _)] = drive(engine, loop)
    # Never tokenized: nothing longer than the room (94 tokens x 10 characters) is encoded.
    assert codec.encoded == []
    assert (sample.end, sample.turns, sample.tool_calls, sample.tool_errors) == ("max_tokens", 1, 1, 1)
    assert len(sample.token_ids) == TURN_TOKENS
    assert loop.tool_error_counts == {"too_large": 1}


class FloodEnv:
    name = "scripted"

    def __init__(self, observation, *, error=""):
        self.observation = observation
        self.error = error

    def reset(self, record):
        return ""

    def step(self, model_turn):
        return Step(self.observation, done=False, tool_calls=1)


@pytest.mark.parametrize(
    ("observation", "encoded"),
    [
        # Within the length bound (94 tokens x 10 characters) but far over on a prefix:
        # only the prefix (4 characters per token left + 256) is tokenized.
        ("1," * 400, [4 * 94 + 256]),
        # The first prefix fits (63 long ids), the next is past the end: then the whole.
        ("999999999," * 63 + "1," * 150, [632, 930]),
        # Short enough to tokenize whole, and 120 tokens for the 94 left.
        ("1," * 120, [240]),
    ],
)
def test_an_observation_over_the_tokens_left_is_too_large(observation, encoded):
    engine = make_engine()
    codec = SpyCodec(lambda: FloodEnv(observation))
    loop = AgentLoop(lambda: engine, codec, max_model_len=128)
    req, params = request(prompt_of(10), n=1, max_total_tokens=100)
    loop.start(0, req, params)
    [(_, _, [sample], _)] = drive(engine, loop)
    assert codec.encoded == encoded
    assert (sample.end, sample.tool_errors) == ("max_tokens", 1)
    assert loop.tool_error_counts == {"too_large": 1}


@dataclass
class KindStep:
    observation: str
    done: bool
    reward: float | None = None
    tool_calls: int = 1
    tool_errors: int = 0
    error: str = ""


class KindEnv:
    """Step 1: an error kind with tool_errors 0 (a user's environment may leave it so);
    step 2: the answer."""

    name = "scripted"

    def __init__(self):
        self.steps = [KindStep("11", done=False, error="too_large"), KindStep("", done=True, tool_calls=0)]

    def reset(self, record):
        return ""

    def step(self, model_turn):
        return self.steps.pop(0)


def test_every_error_kind_counts_as_a_tool_error():
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(KindEnv), max_model_len=128)
    req, params = request(prompt_of(10), n=2)
    loop.start(0, req, params)
    [(_, _, samples, _)] = drive(engine, loop)
    assert [(s.end, s.tool_calls, s.tool_errors) for s in samples] == [("answer", 1, 1)] * 2
    assert loop.tool_error_counts == {"too_large": 2}


class BadRewardEnv:
    name = "scripted"

    def reset(self, record):
        return ""

    def step(self, model_turn):
        return Step("", done=True, reward=float("nan"))


def test_a_non_finite_reward_fails_its_step_not_the_worker():
    engine = make_engine()
    loop = AgentLoop(lambda: engine, IdCodec(BadRewardEnv), max_model_len=128)
    req, params = request(prompt_of(10), n=1)
    loop.start(0, req, params)
    [(_, _, [sample], _)] = drive(engine, loop)
    assert (sample.end, sample.env_reward, sample.tool_errors) == ("error", None, 1)
    assert loop.tool_error_counts == {"step_crash": 1}
