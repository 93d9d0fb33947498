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
weights make every key stale: `reset_prefix_cache` drops them all. Or, for partial
rollouts that keep their stale K/V (`EngineConfig.keep_stale_kv`, PipelineRL's choice), the
keys stay and the chains start from a new root (`KVCacheManager.new_weights`): a request
finds only the current weights' blocks unless it asks for stale ones (`prefix_hit(...,
stale_ok=True)`), and a sequence that started from a stale chain keys its later blocks in
that chain too (their K/V attended to stale ones), so they never reach a fresh request.

Partial blocks (token granularity, for multi-turn trajectories): when a sequence finishes or
is preempted, the partly filled block after its last full one is keyed too, by the hash of
(parent key, its j computed token ids), and remembers those j tokens. A new sequence whose
tokens continue the full blocks and share the first m <= j tokens of such a block (the
longest such m among the blocks under the same parent) starts computing at token m: its
table gets a fresh block and a copy of the cached one is made into it before the step's
writes (copy-on-write), so a keyed block's first j tokens are never overwritten. Every
other holder of a keyed partial block writes only past its j tokens (they are shared
samples of the same prompt), so the key stays true. Partial blocks are evicted and reset
like full ones.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

NULL_BLOCK = 0
ROOT_KEY = 0  # the parent key of a sequence's first block
MAX_STALE_ROOTS = 8  # earlier weights whose K/V a resumed partial rollout may still find


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
        # Keyed partial blocks: block -> (parent key, its cached tokens), and per (parent key, first
        # token) the candidates a longest-prefix match scans (few: one trajectory's, or one group's).
        self._partial: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._partial_children: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a prefix-cache key, full or partial (referenced or not)."""
        return len(self._key_of)

    @property
    def num_cached_partial(self) -> int:
        """Keyed partial blocks (referenced or not)."""
        return len(self._partial)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    def allocate(self) -> int:
        """Take one free block (else evict the least recently used cached one); its reference count becomes 1."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._drop_key(block)
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
        """Key a live, full block by its prefix; False (nothing changes) when the block or the key is taken.

        A block keyed as partial gets its full key instead: its holder filled it (the partial
        tokens are its first ones, so nothing cached is lost but the shorter key)."""
        self._check_live(block)
        if key in self._block_of or (block in self._key_of and block not in self._partial):
            return False
        if block in self._partial:
            self._drop_key(block)
        self._key_of[block] = key
        self._block_of[key] = block
        return True

    def set_partial_key(self, block: int, parent: int, tokens: Sequence[int]) -> bool:
        """Key a live block whose first `len(tokens)` (1..block_size - 1) slots hold the K/V of
        `tokens` after the prefix keyed `parent`. False (nothing changes) when the block holds a
        full key, or a partial one at least as long, or another block holds this very key; a
        shorter partial key of the block is replaced (its holder wrote past it)."""
        self._check_live(block)
        cached = tuple(tokens)
        if not 1 <= len(cached) < self.block_size:
            raise ValueError(f"a partial block holds 1..{self.block_size - 1} tokens, got {len(cached)}")
        key = hash((parent, cached))
        if key in self._block_of:
            return False
        if block in self._key_of:
            old = self._partial.get(block)
            if old is None or len(old[1]) >= len(cached):
                return False
            self._drop_key(block)
        self._key_of[block] = key
        self._block_of[key] = block
        self._partial[block] = (parent, cached)
        self._partial_children.setdefault((parent, cached[0]), {})[block] = cached
        return True

    def longest_partial(self, parent: int, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The keyed partial block under `parent` sharing the longest prefix with `tokens`, and
        that prefix's length: (None, 0) when none shares even the first token."""
        if not tokens:
            return None, 0
        best, best_len = None, 0
        for block, cached in self._partial_children.get((parent, tokens[0]), {}).items():
            n = min(len(cached), len(tokens))
            m = 1  # the first token matches (the index's key)
            while m < n and cached[m] == tokens[m]:
                m += 1
            if m > best_len:
                best, best_len = block, m
        return best, best_len

    def reset_prefix_cache(self) -> int:
        """Forget every key (the weights changed); unreferenced cached blocks become free. Returns the count."""
        dropped = len(self._key_of)
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self._key_of.clear()
        self._block_of.clear()
        self._partial.clear()
        self._partial_children.clear()
        return dropped

    def _drop_key(self, block: int) -> None:
        del self._block_of[self._key_of.pop(block)]
        partial = self._partial.pop(block, None)
        if partial is not None:
            parent, cached = partial
            children = self._partial_children[(parent, cached[0])]
            del children[block]
            if not children:
                del self._partial_children[(parent, cached[0])]

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


@dataclass(frozen=True)
class PrefixHit:
    """The cached part of a new sequence's tokens: `blocks` (full, shared as they are) hold its
    first `len(blocks) * block_size` tokens, and `partial_block`'s first `partial_tokens` slots
    the next ones (copied into a block of its own before it writes there)."""

    blocks: list[int] = field(default_factory=list)
    partial_block: int | None = None
    partial_tokens: int = 0
    root: int = ROOT_KEY  # the key chain the blocks belong to (`KVCacheManager.root`)

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size + self.partial_tokens


@dataclass(frozen=True)
class Allocation:
    """A new sequence's table, and the copy (src, dst) to run before anything writes in the
    step (None: no partial block was taken)."""

    table: BlockTable
    copy: tuple[int, int] | None = None


def block_keys(tokens: Sequence[int], block_size: int, num_blocks: int, root: int = ROOT_KEY) -> list[int]:
    """Prefix-cache keys of the first `num_blocks` full blocks of `tokens`: each hashes its
    parent's key and its own token ids, so equal keys mean equal prefixes (under one `root`)."""
    keys: list[int] = []
    parent = root
    for i in range(num_blocks):
        parent = hash((parent, tuple(tokens[i * block_size : (i + 1) * block_size])))
        keys.append(parent)
    return keys


class KVCacheManager:
    """Allocates, forks, extends and frees block tables over one `BlockPool`.

    With `enable_prefix_caching`, `cached_prefix` finds the keyed blocks a new sequence can
    start from and `cache_full_blocks` keys a table's blocks once their K/V are computed;
    with `enable_partial_blocks` as well, `prefix_hit` also finds a keyed partial block after
    them and `cache_computed_blocks` keys a finished table's partial tail too.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = False,
        enable_partial_blocks: bool = True,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.enable_partial_blocks = enable_partial_blocks
        self.num_cow_copies = 0
        self.num_partial_copies = 0  # copies of keyed partial blocks taken by new sequences
        # The key chains: `root` is the current weights'; `stale_roots` those of earlier
        # weights whose blocks were kept (`new_weights(keep=True)`), newest first.
        self.root = ROOT_KEY
        self.stale_roots: collections.deque[int] = collections.deque(maxlen=MAX_STALE_ROOTS)
        self._weights_epoch = 0

    def new_weights(self, *, keep: bool) -> None:
        """The weights changed: drop every key, or with `keep` start new chains from a fresh
        root and keep the old ones for requests that accept stale K/V."""
        if not keep:
            self.pool.reset_prefix_cache()
            self.stale_roots.clear()
            self.root = ROOT_KEY
            return
        self._weights_epoch += 1
        self.stale_roots.appendleft(self.root)
        self.root = hash(("weights", self._weights_epoch))

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
        for key in block_keys(tokens, self.block_size, (len(tokens) - 1) // self.block_size, self.root):
            block = self.pool.cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def prefix_hit(self, tokens: Sequence[int], *, stale_ok: bool = False) -> PrefixHit:
        """The longest cached prefix of `tokens`, to the token: the keyed full blocks, then the
        keyed partial block under them that shares the most of the next tokens. With
        `stale_ok` the chains of earlier weights count too (the longest hit wins; on a tie the
        newest weights').

        At most `len(tokens) - 1` tokens: the last token is always computed (its logits give
        the first sample)."""
        if not self.enable_prefix_caching:
            return PrefixHit()
        best = self._hit_under(tokens, self.root)
        for root in self.stale_roots if stale_ok else ():
            hit = self._hit_under(tokens, root)
            if hit.num_tokens(self.block_size) > best.num_tokens(self.block_size):
                best = hit
        return best

    def _hit_under(self, tokens: Sequence[int], root: int) -> PrefixHit:
        bs = self.block_size
        hits: list[int] = []
        parent = root
        for key in block_keys(tokens, bs, (len(tokens) - 1) // bs, root):
            block = self.pool.cached_block(key)
            if block is None:
                break
            hits.append(block)
            parent = key
        start = len(hits) * bs
        room = min(bs - 1, len(tokens) - 1 - start)
        if not self.enable_partial_blocks or room < 1:
            return PrefixHit(hits, root=root)
        partial, num = self.pool.longest_partial(parent, tokens[start : start + room])
        return PrefixHit(hits, partial, num, root=root)

    def cache_computed_blocks(
        self, table: BlockTable, tokens: Sequence[int], num_computed: int, root: int | None = None
    ) -> int:
        """Key every block of `table` holding computed K/V of `tokens[:num_computed]`: the full
        ones (`cache_full_blocks`) and, with `enable_partial_blocks`, the partly filled one after
        them, in the chain from `root` (None: the current weights'). Returns how many got a new key."""
        root = self.root if root is None else root
        keyed = self.cache_full_blocks(table, tokens, num_computed, root)
        if not (self.enable_prefix_caching and self.enable_partial_blocks):
            return keyed
        bs = self.block_size
        full, rest = divmod(num_computed, bs)
        if rest == 0 or len(table.blocks) <= full:
            return keyed
        parent = block_keys(tokens, bs, full, root)[-1] if full else root
        return keyed + self.pool.set_partial_key(table.blocks[full], parent, tokens[full * bs : num_computed])

    def cache_full_blocks(
        self, table: BlockTable, tokens: Sequence[int], num_computed: int, root: int | None = None
    ) -> int:
        """Key the full blocks of `table` among its first `num_computed` tokens (`tokens`) in the
        chain from `root` (None: the current weights'); returns how many got a new key (a block
        already keyed, or a prefix keyed in another block, is left)."""
        if not self.enable_prefix_caching:
            return 0
        full = min(num_computed // self.block_size, len(table.blocks))
        keys = block_keys(tokens, self.block_size, full, self.root if root is None else root)
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

    def allocate_hit(self, num_tokens: int, hit: PrefixHit) -> Allocation:
        """`allocate(num_tokens, hit.blocks)`, and when `hit` has a partial block, the copy of it
        into the table's block after the shared ones (the caller runs it before the step writes).

        The partial block is held while the table's blocks are taken, so they never evict it; a
        later allocation of the same step may (it is unreferenced again), which is safe because a
        step runs its copies before any of its writes."""
        if hit.partial_block is None:
            return Allocation(self.allocate(num_tokens, hit.blocks))
        if hit.num_tokens(self.block_size) >= num_tokens:
            raise ValueError(
                f"a prefix hit of {hit.num_tokens(self.block_size)} tokens leaves none of {num_tokens}"
            )
        self.pool.share(hit.partial_block)
        try:
            table = self.allocate(num_tokens, hit.blocks)
        finally:
            self.pool.decref(hit.partial_block)
        self.num_partial_copies += 1
        return Allocation(table, (hit.partial_block, table.blocks[len(hit.blocks)]))

    def blocks_to_allocate_hit(self, num_tokens: int, hit: PrefixHit) -> int:
        """Free blocks `allocate_hit(num_tokens, hit)` needs: `blocks_to_allocate`, plus the
        unreferenced partial block it holds while allocating."""
        held = hit.partial_block is not None and self.pool.is_evictable(hit.partial_block)
        return self.blocks_to_allocate(num_tokens, hit.blocks) + int(held)

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
