"""Admission reserves the next step's blocks and a watermark; recompute shares live prompt blocks.

Block counts in the comments are worked by hand from the block size (4 tokens) and the
copy-on-write rule, independently of the scheduler's own arithmetic.
"""

import random

import pytest
from inference_fakes import check_unaborted_outputs, expected, run_to_completion
from test_scheduler import make, req

from rlax_inference.scheduler import SchedulerConfig
from rlax_inference.sequence import Request


def test_preempted_sample_shares_its_running_siblings_prompt_blocks():
    # 8 blocks of 4 tokens. A: 4-token prompt, 6 new tokens. B: 10-token prompt (2 full
    # blocks + a partial one), 2 samples, 20 new tokens.
    sched, runner = make(num_blocks=8, block_size=4, watermark=0)
    a, b = req(0, 4, n=1, max_tokens=6), req(1, 10, n=2, max_tokens=20)
    sched.add(a)
    sched.add(b)
    frees = []
    for _ in range(5):
        runner.step()
        frees.append(sched.kv.num_free)
    # Step 0 prefills A (1 block) and B (3): 4 free. Step 1: A starts its 2nd block, B's first
    # sample copies the shared tail: 2 free. Step 3: B's samples each start a 4th block: 0 free.
    assert frees == [4, 2, 2, 0, 0]
    out = runner.step()
    # Step 5: A needs its 3rd block; the newest sample (B#1, 15 tokens) is preempted, freeing its
    # 2 own blocks; A takes one and finishes, freeing 3: 4 free.
    assert [(s.request.request_id, s.sample_index) for s in out.preempted] == [("r1", 1)]
    assert sched.kv.num_free == 4
    b0, b1 = b.sequences
    assert len(b1.tokens) == 15
    out = runner.step()
    # Step 6: B#1 comes back. Its 15 tokens span 4 blocks; the first 2 (the full prompt blocks)
    # are B#0's, so it takes 2 blocks: 4 -> 2 free (a private prompt copy would leave 0).
    [job] = out.prefills
    assert job.seqs == [b1] and job.num_shared_tokens == 8
    assert sched.kv.num_free == 2
    assert b1.table.blocks[:2] == b0.table.blocks[:2]
    assert [sched.kv.pool.refcount(x) for x in b1.table.blocks] == [2, 2, 1, 1]
    assert runner.shared_tokens_read == 8  # the prefill found the prompt's K/V already there
    run_to_completion(runner)
    assert [s.output_tokens for s in a.sequences] == expected(a, 48)
    assert [s.output_tokens for s in b.sequences] == expected(b, 48)
    assert sched.kv.num_free == 8


def test_group_waits_for_its_copy_on_write_tails_instead_of_preempting():
    # 5 blocks of 4 tokens. A (3-token prompt, 4 new tokens) runs; then B: a 6-token prompt
    # (one full block + a partial one) in 4 samples.
    sched, runner = make(num_blocks=5, block_size=4, watermark=0)
    a = req(0, 3, n=1, max_tokens=4)
    sched.add(a)
    runner.step()  # A: 1 block, 4 free
    b = req(1, 6, n=4, max_tokens=2)
    sched.add(b)
    # B's prompt takes 2 blocks, which fit; but its first decode copies the partial block for
    # 3 of its 4 samples and A starts a 2nd block: 2 + 3 + 1 = 6 > 4. Admitting B now (the
    # prompt-only rule) would preempt at the very next step; it waits until A is done.
    admitted_at = None
    for step in range(1, 20):
        out = runner.step()
        if out.prefills:
            admitted_at = step
        if not sched.has_unfinished:
            break
    # A makes a token per step (prefill, then steps 1..3) and frees its 2 blocks at step 3:
    # 5 free = 2 + 3, so B starts at step 4.
    assert admitted_at == 4
    assert sched.num_preemptions == 0 and sched.num_forced_admissions == 0
    assert [s.output_tokens for s in b.sequences] == expected(b, 48)
    assert sched.kv.num_free == 5


def test_sequences_finishing_this_step_reserve_nothing_for_the_next():
    # 5 blocks of 4 tokens. A: 3-token prompt, 2 new tokens; it makes its last token at step 1.
    sched, runner = make(num_blocks=5, block_size=4, watermark=0)
    a = req(0, 3, n=1, max_tokens=2)
    sched.add(a)
    runner.step()  # A: 1 block, 4 free
    b = req(1, 12, n=1, max_tokens=2)  # 3 full blocks, then a new one at its first decode
    sched.add(b)
    out = runner.step()
    # Step 1: A writes token 3 in place and is done, so its 5th token's block is not reserved:
    # B's 3 + 1 blocks fit the 4 free. (Reserving A's next block too would make it wait.)
    assert [j.request.request_id for j in out.prefills] == ["r1"]
    run_to_completion(runner)
    assert sched.num_preemptions == 0
    assert [s.output_tokens for s in b.sequences] == expected(b, 48)
    assert sched.kv.num_free == 5


@pytest.mark.parametrize(("watermark", "admitted_at"), [(0.0, 1), (0.1, 3)])
def test_watermark_keeps_blocks_free_at_admission(watermark, admitted_at):
    # 20 blocks of 4 tokens; a watermark of 0.1 keeps int(0.1 * 20) = 2 of them free.
    sched, runner = make(num_blocks=20, block_size=4, watermark=watermark)
    assert sched.watermark_blocks == int(watermark * 20)
    a = req(0, 40, n=1, max_tokens=3)  # 10 full blocks
    sched.add(a)
    runner.step()  # A: 10 blocks, 10 free
    b = req(1, 28, n=1, max_tokens=2)  # 7 full blocks, then a new block at its first decode
    sched.add(b)
    # Step 1: A starts an 11th block (9 free) and its next token fits in it. B needs 7 + 1
    # blocks: 8 <= 9 without a watermark, 8 + 2 > 9 with it, so B waits until A ends (step 2).
    started = None
    for step in range(1, 10):
        out = runner.step()
        if out.prefills:
            started = step
        if not sched.has_unfinished:
            break
    assert started == admitted_at
    assert sched.num_preemptions == 0
    assert [s.output_tokens for s in b.sequences] == expected(b, 48)
    assert sched.kv.num_free == 20


def test_watermark_must_be_a_fraction():
    for bad in (-0.1, 1.0, "0.1"):
        with pytest.raises(ValueError, match="watermark"):
            SchedulerConfig(watermark=bad)


def test_group_too_large_for_its_reservation_still_runs_when_alone():
    # 5 blocks: a 6-token prompt in 5 samples needs 2 + 4 copies = 6 > 5, so it can never be
    # admitted with its reservation; alone in the engine it starts anyway and preempts its
    # own samples, as before.
    sched, runner = make(num_blocks=5, block_size=4, watermark=0)
    b = req(0, 6, n=5, max_tokens=4)
    sched.add(b)
    run_to_completion(runner)
    assert sched.num_forced_admissions == 1
    assert sched.num_preemptions > 0
    assert [s.output_tokens for s in b.sequences] == expected(b, 48)
    assert sched.kv.num_free == 5


@pytest.mark.parametrize(("num_steps", "watermark"), [(1, 0.0), (1, 0.05), (4, 0.05)])
def test_random_requests_never_preempted_right_after_admission(num_steps, watermark):
    rng = random.Random(99 + num_steps)
    # 40 blocks: the largest request (29-token prompt = 8 blocks, + 4 blocks for its first
    # decode, + 2 watermark blocks) fits an empty pool, so no admission is forced.
    sched, runner = make(
        num_blocks=40,
        block_size=4,
        max_num_seqs=16,
        max_num_batched_tokens=96,
        num_steps=num_steps,
        watermark=watermark,
    )
    admitted_step: dict[int, int] = {}  # seq_id -> step of its latest (re-)admission
    live: list[Request] = []
    done: list[Request] = []
    step = 0
    checked_next_steps = 0

    def run_step() -> None:
        nonlocal step, checked_next_steps
        out = runner.step()
        for seq in out.preempted:
            assert admitted_step.get(seq.seq_id) != step - 1, (
                f"seq {seq.seq_id} preempted right after admission"
            )
        checked_next_steps += sum(admitted_step.get(s.seq_id) == step - 1 for s in out.decodes)
        for job in out.prefills:
            for seq in job.seqs:
                admitted_step[seq.seq_id] = step
        step += 1

    for i in range(400):
        r = req(i, rng.randrange(1, 30), n=rng.choice([1, 2, 4]), max_tokens=rng.randrange(1, 20), rng=rng)
        sched.add(r)
        live.append(r)
        if rng.random() < 0.5:
            run_step()
        if rng.random() < 0.1:
            sched.abort(rng.choice(live).request_id)
        for r in [r for r in live if r.finished]:
            live.remove(r)
            done.append(r)
    while sched.has_unfinished:
        run_step()
    done += live
    assert sched.kv.num_used == 0 and sched.kv.num_free == 40  # no block leaked
    assert sched.num_preemptions > 0  # the pool was tight enough to matter
    assert sched.num_forced_admissions == 0
    assert checked_next_steps > 100
    n_checked = check_unaborted_outputs(done, 48)
    assert n_checked > 200
