import random

import pytest
from inference_fakes import PagedFakeRunner, check_unaborted_outputs, expected, run_to_completion

from rlax_inference.block_pool import KVCacheManager
from rlax_inference.scheduler import Scheduler, SchedulerConfig
from rlax_inference.sequence import Request, SamplingParams


def make(num_blocks=64, block_size=4, num_steps=1, prefix_caching=False, **cfg):
    config = SchedulerConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 48, **cfg})
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))
    return sched, PagedFakeRunner(sched, num_steps)


def req(i, prompt_len, n=1, max_tokens=8, rng=None):
    rng = rng or random.Random(i)
    prompt = [rng.randrange(50) for _ in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(n=n, max_tokens=max_tokens), arrival=i)


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=100, max_model_len=200)


def test_continuous_batching_fifo_and_caps():
    sched, runner = make(max_num_seqs=2)
    reqs = [req(i, 5, max_tokens=3 + 3 * (i == 0)) for i in range(4)]
    for r in reqs:
        sched.add(r)
    out = runner.step()
    assert [j.request.request_id for j in out.prefills] == ["r0", "r1"]  # cap of 2 running
    seen_joined = False
    while sched.has_unfinished:
        out = runner.step()
        # r2 joins as soon as r1 finishes, while r0 keeps decoding.
        if any(j.request.request_id == "r2" for j in out.prefills):
            assert [s.request.request_id for s in out.decodes] == ["r0"]
            seen_joined = True
        assert len(sched.running) <= 2
    assert seen_joined
    for r in reqs:
        assert [s.output_tokens for s in r.sequences] == expected(r, 48)


def test_token_budget_limits_prefill_per_step():
    sched, runner = make(max_num_batched_tokens=48, max_model_len=48)
    for i in range(3):
        sched.add(req(i, 20))
    out = runner.step()
    assert [len(j.tokens) for j in out.prefills] == [20, 20]
    assert out.num_batched_tokens <= 48
    out = runner.step()
    assert out.num_batched_tokens == 2 + 20


def test_group_shares_prompt_blocks():
    sched, runner = make(num_blocks=64, block_size=4)
    r = req(0, 10, n=8, max_tokens=6)
    sched.add(r)
    runner.step()  # prefill + first token of every sample
    assert sched.kv.num_used == 3  # 10 prompt tokens in 3 blocks, stored once
    runner.step()  # tokens 10 (sampled first token) written: each sample now owns its tail
    # 2 shared full prompt blocks + one tail block per sample
    assert sched.kv.num_used == 2 + 8
    run_to_completion(runner)
    assert [s.output_tokens for s in r.sequences] == expected(r, 48)
    assert sched.kv.num_free == 64


@pytest.mark.parametrize("num_steps", [1, 4])
def test_preemption_by_recomputation_gives_same_output(num_steps):
    # 14 blocks of 4 tokens: far fewer than 6 sequences of up to 40 tokens need.
    sched, runner = make(num_blocks=14, block_size=4, max_num_seqs=6, num_steps=num_steps)
    reqs = [req(i, 6 + i, n=1 + (i % 2), max_tokens=20) for i in range(4)]
    for r in reqs:
        sched.add(r)
    run_to_completion(runner)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert [s.output_tokens for s in r.sequences] == expected(r, 48)
    assert sched.kv.num_free == 14


def test_bad_requests_rejected_before_queueing():
    sched, _ = make()
    with pytest.raises(ValueError, match="context length is 48"):
        sched.add(req(0, 48))
    with pytest.raises(ValueError, match="n=9 samples exceed max_num_seqs=8"):
        sched.add(req(1, 4, n=9))
    assert not sched.has_unfinished


@pytest.mark.parametrize("num_steps", [1, 5])
def test_thousand_random_requests_with_aborts_free_every_block(num_steps):
    rng = random.Random(1234)
    sched, runner = make(
        num_blocks=40, block_size=4, max_num_seqs=16, max_num_batched_tokens=96, num_steps=num_steps
    )
    live: list[Request] = []
    done: list[Request] = []
    for i in range(1000):
        r = req(i, rng.randrange(1, 30), n=rng.choice([1, 1, 2, 4]), max_tokens=rng.randrange(1, 20), rng=rng)
        sched.add(r)
        live.append(r)
        if rng.random() < 0.3:
            runner.step()
        if rng.random() < 0.1 and live:
            victim = rng.choice(live)
            sched.abort(victim.request_id)
        for r in [r for r in live if r.finished]:
            live.remove(r)
            done.append(r)
    run_to_completion(runner)
    done += live
    assert sched.kv.num_free == 40 and sched.kv.num_used == 0
    assert sched.num_preemptions > 0
    n_checked = check_unaborted_outputs(done, 48)
    assert n_checked > 500


def test_multi_step_decode_reserves_each_sequence_its_own_token_count():
    sched, runner = make(num_blocks=64, block_size=4, num_steps=4, max_model_len=16)
    short = req(0, 5, max_tokens=3)  # 1 token from the prefill, then 2 more: capped below 4
    near_end = req(1, 12, max_tokens=10)  # the 16-token context leaves 4 - 1 = 3 after the prefill token
    shared = req(2, 6, n=2, max_tokens=9)  # two samples over one prompt block with a shared partial tail
    for r in (short, near_end, shared):
        sched.add(r)
    runner.step()  # prefills
    out = runner.step()
    assert [len(s) for s in out.decode_slots] == [2, 3, 4, 4]
    for slots in out.decode_slots:  # consecutive positions of one sequence: distinct slots
        assert len(set(slots)) == len(slots)
    assert len(out.copies) == 1  # the second sample copies the shared tail once, on its first append
    run_to_completion(runner)
    for r in (short, near_end, shared):
        assert [s.output_tokens for s in r.sequences] == expected(r, 16)
    assert sched.kv.num_free == 64


def test_multi_step_falls_back_to_single_steps_when_blocks_are_short():
    sched, runner = make(num_blocks=6, block_size=4, num_steps=8, max_num_seqs=2)
    for i in range(2):
        sched.add(req(i, 7, max_tokens=12))
    runner.step()  # prefills: 2 blocks each, 2 free
    out = runner.step()
    assert [len(s) for s in out.decode_slots] == [1, 1]  # 8 more tokens each would need 4 blocks
    run_to_completion(runner)
    assert sched.num_preemptions > 0
