"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with reference counts.

A sequence owns a `BlockTable` (the physical block ids that hold its KV entries, in
order). Forking a table (the G samples of one prompt) shares every block by raising
its reference count; the first write into a shared, partly filled last block copies it
(copy-on-write), so samples never see each other's tokens while the prompt's full
blocks stay stored once.

Physical page 0 of the device cache is never handed out: padded rows of a batch write
their throw-away K/V there, so block ids run from 1 to `num_blocks`.

Automatic prefix cache (vLLM's): once a full block's K/V are computed, the block is keyed
by the hash of (its parent block's key, its token ids), so a key names the whole prefix up
to the block's end. A block whose reference count drops to zero keeps its key and contents
and waits in an LRU list; it counts as free, and allocation evicts the least recently used
one (dropping its key) only when no plain free block is left. A new sequence whose tokens
start with keyed blocks takes them (reference count + 1) instead of computing them. New
weights make every key stale: `reset_prefix_cache` drops them all.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than the pool has free."""


class BlockPool:
    """Reference-counted free list of KV blocks `1..num_blocks` (0 is the null page)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refcount = [0] * (num_blocks + 1)
        # Popping from the end hands out low ids first, which keeps tests readable.
        self._free = list(range(num_blocks, 0, -1))
        self.peak_used = 0
        # Prefix cache: key -> block, block -> key, and the unreferenced keyed blocks in LRU order.
        self._block_of: dict[int, int] = {}
        self._key_of: dict[int, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a prefix-cache key (referenced or not)."""
        return len(self._key_of)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def allocate(self) -> int:
        """Take one free block (else evict the least recently used cached one); its reference count becomes 1."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(block)]
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} KV blocks are in use")
        self._refcount[block] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return block

    def incref(self, block: int) -> None:
        self._check_live(block)
        self._refcount[block] += 1

    def decref(self, block: int) -> None:
        """Drop one reference; at zero a cached block waits in the LRU list, any other is free."""
        self._check_live(block)
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block in self._key_of:
                self._evictable[block] = None  # most recently used last
            else:
                self._free.append(block)

    # -- prefix cache ---------------------------------------------------------------
    def cached_block(self, key: int) -> int | None:
        """The block holding the prefix keyed `key`, if any (nothing changes)."""
        return self._block_of.get(key)

    def is_evictable(self, block: int) -> bool:
        return block in self._evictable

    def share(self, block: int) -> None:
        """One more reference to a live block, or revive an unreferenced cached one."""
        self._check_id(block)
        if self._refcount[block] == 0:
            if block not in self._evictable:
                raise ValueError(f"block {block} is free (reference count 0)")
            del self._evictable[block]
            self.peak_used = max(self.peak_used, self.num_used)
        self._refcount[block] += 1

    def set_key(self, block: int, key: int) -> bool:
        """Key a live, full block by its prefix; False (nothing changes) when the block or the key is taken."""
        self._check_live(block)
        if block in self._key_of or key in self._block_of:
            return False
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every key (the weights changed); unreferenced cached blocks become free. Returns the count."""
        dropped = len(self._key_of)
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        return dropped

    def _check_id(self, block: int) -> None:
        if not 1 <= block <= self.num_blocks:
            raise ValueError(f"block id {block} outside 1..{self.num_blocks}")

    def _check_live(self, block: int) -> None:
        self._check_id(block)
        if self._refcount[block] <= 0:
            raise ValueError(f"block {block} is free (reference count 0)")


@dataclass
class BlockTable:
    """Physical blocks of one sequence's KV cache and how many tokens they hold."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True)
class SlotAssignment:
    """Where the next token's K/V goes, and a block copy to run before writing it."""

    slot: int  # physical slot = block * block_size + offset
    copy_from: int | None = None  # copy-on-write: copy this block into `copy_to` first
    copy_to: int | None = None


def block_keys(tokens: Sequence[int], block_size: int, num_blocks: int) -> list[int]:
    """Prefix-cache keys of the first `num_blocks` full blocks of `tokens`: each hashes its
    parent's key and its own token ids, so equal keys mean equal prefixes."""
    keys: list[int] = []
    parent = 0
    for i in range(num_blocks):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


class KVCacheManager:
    """Allocates, forks, extends and frees block tables over one `BlockPool`.

    With `enable_prefix_caching`, `cached_prefix` finds the keyed blocks a new sequence can
    start from and `cache_full_blocks` keys a table's blocks once their K/V are computed.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_cow_copies = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The keyed blocks that hold the longest cached prefix of `tokens`, in order.

        At most `(len(tokens) - 1) // block_size` blocks: the last token is always computed
        (its logits give the first sample).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for key in block_keys(tokens, self.block_size, (len(tokens) - 1) // self.block_size):
            block = self.pool.cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, table: BlockTable, tokens: Sequence[int], num_computed: int) -> int:
        """Key the full blocks of `table` among its first `num_computed` tokens (`tokens`); returns
        how many got a new key (a block already keyed, or a prefix keyed in another block, is left)."""
        if not self.enable_prefix_caching:
            return 0
        full = min(num_computed // self.block_size, len(table.blocks))
        keys = block_keys(tokens, self.block_size, full)
        return sum(self.pool.set_key(block, key) for block, key in zip(table.blocks, keys, strict=False))

    def blocks_to_allocate(self, num_tokens: int, shared: Sequence[int] = ()) -> int:
        """Free blocks `allocate(num_tokens, shared)` takes: its fresh blocks plus the shared
        blocks it revives from the prefix cache's LRU list."""
        revived = sum(self.pool.is_evictable(b) for b in shared)
        return self.blocks_for(num_tokens) - len(shared) + revived

    def allocate(self, num_tokens: int, shared: list[int] | tuple[int, ...] = ()) -> BlockTable:
        """A table with room for `num_tokens` tokens whose first blocks are `shared` (full blocks
        of another table or of the prefix cache, reference counts + 1) and whose other blocks are fresh."""
        if len(shared) * self.block_size > num_tokens:
            raise ValueError(f"{len(shared)} shared blocks hold more than the table's {num_tokens} tokens")
        need = self.blocks_to_allocate(num_tokens, shared)
        if need > self.pool.num_free:
            raise NoFreeBlocksError(f"need {need} blocks for {num_tokens} tokens, {self.pool.num_free} free")
        for block in shared:
            self.pool.share(block)
        fresh = self.blocks_for(num_tokens) - len(shared)
        return BlockTable([*shared, *(self.pool.allocate() for _ in range(fresh))], num_tokens)

    def fork(self, table: BlockTable) -> BlockTable:
        """A second table that shares every block of `table` (reference counts + 1)."""
        for block in table.blocks:
            self.pool.incref(block)
        return BlockTable(list(table.blocks), table.num_tokens)

    def blocks_needed_to_append(self, table: BlockTable, num_tokens: int = 1) -> int:
        """The blocks `num_tokens` calls of `append_slot` would allocate: the new blocks past the
        table's capacity, plus the copy of a shared, partly filled last block (0 or 1 for one token)."""
        shared_tail = table.num_tokens % self.block_size != 0 and self.pool.refcount(table.blocks[-1]) > 1
        return self.blocks_for(table.num_tokens + num_tokens) - len(table.blocks) + int(shared_tail)

    def append_slot(self, table: BlockTable) -> SlotAssignment:
        """Reserve the slot of token `table.num_tokens`, copying a shared tail block first."""
        offset = table.num_tokens % self.block_size
        if offset and self.pool._refcount[table.blocks[-1]] == 1:  # the common case: room in an own block
            table.num_tokens += 1
            return SlotAssignment(table.blocks[-1] * self.block_size + offset)
        copy_from = copy_to = None
        if offset == 0:
            table.blocks.append(self.pool.allocate())
        else:
            last = table.blocks[-1]
            if self.pool.refcount(last) > 1:
                new = self.pool.allocate()
                self.pool.decref(last)
                table.blocks[-1] = new
                copy_from, copy_to = last, new
                self.num_cow_copies += 1
        table.num_tokens += 1
        return SlotAssignment(table.blocks[-1] * self.block_size + offset, copy_from, copy_to)

    def append_slots(self, table: BlockTable, num_tokens: int) -> tuple[list[int], list[tuple[int, int]]]:
        """`append_slot` `num_tokens` times: the slots, and the (src, dst) block copies to run first.

        Runs of slots inside an exclusively owned block are taken at once (multi-step decoding
        reserves several slots per sequence every step).
        """
        slots: list[int] = []
        copies: list[tuple[int, int]] = []
        bs = self.block_size
        while len(slots) < num_tokens:
            offset = table.num_tokens % bs
            if offset and self.pool._refcount[table.blocks[-1]] == 1:
                take = min(num_tokens - len(slots), bs - offset)
                start = table.blocks[-1] * bs + offset
                slots.extend(range(start, start + take))
                table.num_tokens += take
                continue
            slot = self.append_slot(table)
            if slot.copy_from is not None:
                copies.append((slot.copy_from, slot.copy_to))  # type: ignore[arg-type]
            slots.append(slot.slot)
        return slots, copies

    def free(self, table: BlockTable) -> None:
        for block in table.blocks:
            self.pool.decref(block)
        table.blocks.clear()
        table.num_tokens = 0

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used
