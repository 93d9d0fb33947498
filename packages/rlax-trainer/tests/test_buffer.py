from __future__ import annotations

import msgspec
import numpy as np
import pytest

from rlax_protocol import Rollout
from rlax_trainer.buffer import RolloutBuffer, collate, validate_group

G = 3


def group(prompt: str, version: int, *, reward: float = 1.0, completion=(5, 6), **changes) -> list[Rollout]:
    out = []
    for i in range(G):
        fields = dict(
            prompt_id=prompt,
            group_index=i,
            prompt_token_ids=(1, 2, 3),
            completion_token_ids=tuple(completion[: i + 1]) if len(completion) > 1 else tuple(completion),
            worker_logprobs=tuple([-0.5] * len(completion[: i + 1] if len(completion) > 1 else completion)),
            policy_version=version,
            reward=reward + i,
        )
        fields.update(changes)
        out.append(Rollout(**fields))
    return out


def test_never_yields_stale_and_counts_discards():
    k = 2
    buf = RolloutBuffer(group_size=G, max_staleness=k)
    rng = np.random.default_rng(0)
    current = 0
    taken_versions = []
    for step in range(40):
        for _ in range(rng.integers(0, 3)):
            v = int(rng.integers(max(0, current - 4), current + 1))
            buf.add(group(f"p{step}-{v}-{rng.integers(1 << 30)}", v), current_version=current)
        got = buf.take(2, current)
        if got is not None:
            for g in got:
                assert current - g[0].policy_version <= k
                taken_versions.append(g[0].policy_version)
            current += 1
    s = buf.stats()
    assert s.expired_groups > 0 and s.expired_rollouts == G * s.expired_groups
    assert s.added_groups == s.taken_groups + s.expired_groups + s.pending_groups
    assert taken_versions


def test_prefers_newest_then_arrival():
    buf = RolloutBuffer(group_size=G, max_staleness=5)
    for name, v in [("a", 3), ("b", 5), ("c", 4), ("d", 5)]:
        buf.add(group(name, v))
    got = buf.take(3, current_version=6)
    assert [g[0].prompt_id for g in got] == ["b", "d", "c"]
    assert buf.take(2, current_version=6) is None
    assert len(buf) == 1
    # a (version 3) is 4 behind 7 -> still fine with k=5; at 9 it expires.
    assert buf.expire(9) == 1 and buf.stats().expired_groups == 1


def test_capacity_drops_oldest():
    buf = RolloutBuffer(group_size=G, max_staleness=10, capacity=2)
    for name, v in [("a", 1), ("b", 3), ("c", 2)]:
        buf.add(group(name, v))
    assert [g[0].prompt_id for g in buf.take(2, 3)] == ["b", "c"]
    assert buf.stats().expired_groups == 1


def test_bad_rollouts_are_named():
    with pytest.raises(ValueError, match="worker_logprobs"):
        Rollout(
            prompt_id="x",
            group_index=0,
            prompt_token_ids=(1,),
            completion_token_ids=(2, 3),
            worker_logprobs=(-1.0,),
            policy_version=0,
            reward=1.0,
        )
    buf = RolloutBuffer(group_size=G, max_staleness=1)
    with pytest.raises(ValueError, match="expected group_size=3"):
        buf.add(group("x", 0)[:2])
    with pytest.raises(ValueError, match="reward=None"):
        buf.add([msgspec.structs.replace(r, reward=None) for r in group("x", 0)])
    bad = group("x", 0)
    bad[1] = msgspec.structs.replace(bad[1], prompt_id="y")
    with pytest.raises(ValueError, match="rollout 1 of prompt 'y': prompt_id differs"):
        validate_group(bad, G)
    bad = group("x", 0)
    bad[2] = msgspec.structs.replace(bad[2], policy_version=1)
    with pytest.raises(ValueError, match="policy_version=1 differs"):
        validate_group(bad, G)
    with pytest.raises(ValueError, match="newer than the trainer's 2"):
        buf.add(group("x", 3), current_version=2)
    bad = group("x", 0)
    bad[0] = msgspec.structs.replace(bad[0], group_index=2)
    with pytest.raises(ValueError, match="group_index"):
        validate_group(bad, G)
    with pytest.raises(ValueError, match="worker_logprobs must be finite"):
        validate_group(
            [
                msgspec.structs.replace(r, worker_logprobs=(float("nan"),) * len(r.worker_logprobs))
                for r in group("x", 0)
            ],
            G,
        )
    assert len(buf) == 0 and buf.stats().added_groups == 0


def test_collate_layout():
    g = group("p", 1, completion=(7, 8, 9))
    batch = collate([g], pad_id=0, seq_len=8)
    assert batch.tokens.shape == (3, 8) and batch.mask.shape == (3, 7)
    np.testing.assert_array_equal(batch.tokens[2], [1, 2, 3, 7, 8, 9, 0, 0])
    np.testing.assert_array_equal(batch.mask[0], [0, 0, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch.mask[2], [0, 0, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.worker_logprobs[2], [0, 0, -0.5, -0.5, -0.5, 0, 0])
    np.testing.assert_array_equal(batch.valid[1], [1, 1, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.rewards, [1, 2, 3])
    # Every masked logprob position predicts exactly a completion token.
    for i in range(3):
        targets = batch.tokens[i, 1:][batch.mask[i] > 0]
        np.testing.assert_array_equal(targets, g[i].completion_token_ids)
    with pytest.raises(ValueError, match="more than seq_len=5"):
        collate([g], seq_len=5)


def test_collate_masks_out_the_environment_turns_of_a_trajectory():
    # prompt (1 2 3) | model 7 8 | environment 40 41 42 | model 9 | environment 43 | model 10 11
    completion = (7, 8, 40, 41, 42, 9, 43, 10, 11)
    model = (1, 1, 0, 0, 0, 1, 0, 1, 1)
    logprobs = tuple(-0.25 * (i + 1) if m else 0.0 for i, m in enumerate(model))
    rollout = Rollout(
        prompt_id="p", group_index=0, prompt_token_ids=(1, 2, 3), completion_token_ids=completion,
        worker_logprobs=logprobs, policy_version=0, reward=1.0, completion_mask=model,
    )  # fmt: skip
    batch = collate([[rollout]], pad_id=0, seq_len=14)
    # Logprob index t scores token t+1: the scored tokens are exactly the model's.
    np.testing.assert_array_equal(batch.mask[0], [0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.tokens[0, 1:][batch.mask[0] > 0], [7, 8, 9, 10, 11])
    np.testing.assert_array_equal(
        batch.worker_logprobs[0][batch.mask[0] > 0], [-0.25, -0.5, -1.5, -2.0, -2.25]
    )
    np.testing.assert_array_equal(batch.valid[0], [1] * 12 + [0, 0])
    with pytest.raises(ValueError, match="completion_mask"):
        Rollout(**{**msgspec.structs.asdict(rollout), "completion_mask": model[:-1]})
