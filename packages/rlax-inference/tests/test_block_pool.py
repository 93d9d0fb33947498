import pytest

from rlax_inference.block_pool import BlockPool, KVCacheManager, NoFreeBlocksError


def test_pool_refcounts_and_free_list():
    pool = BlockPool(4, 16)
    a, b = pool.allocate(), pool.allocate()
    assert (a, b) == (1, 2) and pool.num_used == 2 and pool.num_free == 2
    pool.incref(a)
    pool.decref(a)
    assert pool.refcount(a) == 1 and pool.num_used == 2
    pool.decref(a)
    assert pool.refcount(a) == 0 and pool.num_free == 3
    with pytest.raises(ValueError, match="is free"):
        pool.decref(a)
    with pytest.raises(ValueError, match="outside 1..4"):
        pool.incref(0)
    pool.allocate(), pool.allocate(), pool.allocate()
    with pytest.raises(NoFreeBlocksError):
        pool.allocate()
    assert pool.peak_used == 4


def test_fork_shares_full_blocks_and_copies_partial_tail_on_write():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    prompt = kv.allocate(10)  # blocks: 4 + 4 + 2 tokens
    assert len(prompt.blocks) == 3 and kv.num_used == 3
    samples = [prompt] + [kv.fork(prompt) for _ in range(7)]
    assert kv.num_used == 3
    assert all(kv.pool.refcount(b) == 8 for b in prompt.blocks)
    tails = set()
    for t in samples:
        slot = kv.append_slot(t)
        tails.add(t.blocks[-1])
        assert t.blocks[:2] == samples[0].blocks[:2]  # full prompt blocks stay shared
        assert slot.slot == t.blocks[-1] * 4 + 2
    # 7 samples copied the shared tail; the last one wrote into it in place.
    assert kv.num_cow_copies == 7 and len(tails) == 8
    assert kv.num_used == 2 + 8
    for t in samples:
        assert kv.blocks_needed_to_append(t) == 0
        kv.append_slot(t)  # token 12: fills the tail block
        assert kv.blocks_needed_to_append(t) == 1
    for t in samples:
        kv.free(t)
    assert kv.num_free == 32


def test_append_to_exclusive_full_block_allocates():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    t = kv.allocate(2)
    s = kv.append_slot(t)
    assert s.copy_from is None and len(t.blocks) == 2 and s.slot == t.blocks[1] * 2
    with pytest.raises(NoFreeBlocksError):
        kv.allocate(7)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 9])
def test_blocks_needed_for_several_appends_match_what_appending_takes(num_tokens):
    block_size = 4
    for length in range(1, 13):
        for shared in (False, True):
            kv = KVCacheManager(num_blocks=64, block_size=block_size)
            table = kv.allocate(length)
            other = kv.fork(table) if shared else None
            predicted = kv.blocks_needed_to_append(table, num_tokens)
            before = kv.num_free
            for _ in range(num_tokens):
                kv.append_slot(table)
            assert predicted == before - kv.num_free, (length, shared)
            # The scheduler's quick bound: ceil((n - 1) / block_size) new blocks plus one copy.
            assert predicted <= -(-(num_tokens - 1) // block_size) + 1
            del other


def test_append_slots_equals_appending_one_slot_at_a_time():
    """Bulk reservation (multi-step decoding) hands out the same slots, copies and blocks as single appends."""
    import random

    rng = random.Random(5)
    bulk, single = KVCacheManager(num_blocks=400, block_size=4), KVCacheManager(num_blocks=400, block_size=4)
    for _ in range(40):
        prompt_len = rng.randint(1, 11)
        tables = [(bulk.allocate(prompt_len), single.allocate(prompt_len))]
        tables += [(bulk.fork(tables[0][0]), single.fork(tables[0][1])) for _ in range(rng.randint(0, 3))]
        for _ in range(3):
            for tb, ts in tables:
                n = rng.randint(1, 9)
                slots, copies = bulk.append_slots(tb, n)
                expected_slots, expected_copies = [], []
                for _ in range(n):
                    s = single.append_slot(ts)
                    expected_slots.append(s.slot)
                    if s.copy_from is not None:
                        expected_copies.append((s.copy_from, s.copy_to))
                assert (slots, copies) == (expected_slots, expected_copies)
                assert (tb.blocks, tb.num_tokens) == (ts.blocks, ts.num_tokens)
        for tb, ts in tables:
            bulk.free(tb)
            single.free(ts)
        assert bulk.num_free == single.num_free == 400


def test_allocate_shares_leading_full_blocks():
    kv = KVCacheManager(8, 4)
    sibling = kv.allocate(10)  # blocks 1, 2 (full) and 3 (partial)
    table = kv.allocate(15, shared=sibling.blocks[:2])  # 15 tokens: 4 blocks, 2 of them shared
    assert table.blocks == [1, 2, 4, 5] and table.num_tokens == 15
    assert [kv.pool.refcount(b) for b in range(1, 6)] == [2, 2, 1, 1, 1]
    assert kv.num_free == 3
    with pytest.raises(ValueError, match="shared blocks hold more"):
        kv.allocate(7, shared=sibling.blocks[:2])  # 2 full blocks are 8 tokens
    with pytest.raises(NoFreeBlocksError):
        kv.allocate(30, shared=sibling.blocks[:2])  # 8 blocks, 6 new, 3 free
    assert kv.num_free == 3  # a failed allocation takes no references
    kv.free(sibling)
    kv.free(table)
    assert kv.num_free == 8
