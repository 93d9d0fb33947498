"""Continuous-batching scheduler: which sequences prefill and decode in each step.

Every step first gives each running sequence one decode slot (oldest first); when the
pool runs dry it preempts the newest running sequences, frees their blocks and puts
them back at the head of the queue to be recomputed (prefill over prompt + generated
tokens, which reproduces the same continuation because sampling keys depend only on
(seed, sample, step)). Then, unless something was preempted, it admits waiting prefill
jobs in FIFO order while the token budget, the running-sequence cap and the free
blocks allow. A fresh request is prefilled once and forked into its `n` samples.

Admission reserves more than the prompt: the blocks every running sequence and every
admitted job needs for its next decode token (for a group of `n` with a partly filled last
prompt block, the `n - 1` copy-on-write copies of that block; with a full one, `n` new
blocks), plus a watermark of `int(watermark * num_blocks)` blocks kept free. So a sequence
admitted in one step is never preempted in the next. When nothing runs, the head of the
queue is admitted on its prompt blocks alone, so a group too large for the pool still makes
progress (by preempting its own samples, as before).

A preempted sample that still has a running sibling shares that sibling's full prompt
blocks again (reference counts + 1) instead of a private copy: its recompute allocates only
its tail, and its prefill leaves the shared tokens' K/V as they are (`PrefillJob.num_shared_tokens`).

Chunked prefill (`SchedulerConfig.chunked_prefill`, vLLM's): a job's tokens are prefilled
over as many steps as the token budget needs, at most `prefill_chunk_size` tokens per step,
each chunk attending to the earlier ones through the cache. An admitted job holds all its
blocks from the start and stays in `prefilling` until its last chunk ran; jobs in progress
go before new admissions. Automatic prefix caching (`KVCacheManager.enable_prefix_caching`):
a new job takes the keyed blocks that hold the longest cached prefix of its tokens and
computes only the rest; its full blocks are keyed as its chunks complete. A finished or
preempted sequence's blocks are keyed to the token (`KVCacheManager.cache_computed_blocks`),
so a job continuing it (the next turn of a trajectory, a recompute) takes its partly filled
last block as well: admission puts the copy of that block into the step's `copies`, which
the step runs before any write, and the job computes from the first token past the hit.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field

from rlax_inference.block_pool import ROOT_KEY, BlockTable, KVCacheManager, PrefixHit
from rlax_inference.sequence import FinishReason, Request, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one scheduling step.

    max_num_seqs: cap on sequences running (decoding or prefilling) at once.
    max_num_batched_tokens: token budget of one step (decode tokens + prefill tokens).
    chunked_prefill: prefill long prompts over several steps, within the token budget
      (otherwise a job is prefilled at once, and the budget must hold the longest one).
    prefill_chunk_size: at most this many tokens of one job per step (None: the budget).
    max_model_len: context length; prompt + generated tokens never exceed it.
    watermark: fraction of the pool's blocks admission keeps free beyond the next step's
      needs (vLLM's watermark); `int(watermark * num_blocks)` blocks, so 0 for pools under
      `1 / watermark` blocks.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 1024
    watermark: float = 0.01
    chunked_prefill: bool = False
    prefill_chunk_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.watermark, int | float) or not 0 <= self.watermark < 1:
            raise ValueError(f"SchedulerConfig.watermark must be a number in [0, 1), got {self.watermark!r}")
        if self.prefill_chunk_size is not None and (
            not isinstance(self.prefill_chunk_size, int) or self.prefill_chunk_size < 1
        ):
            raise ValueError(
                f"SchedulerConfig.prefill_chunk_size must be None or an int >= 1, got {self.prefill_chunk_size!r}"
            )
        if self.chunked_prefill:
            # A prefilling job's samples count against max_num_seqs, so the decodes beside it
            # leave room in the budget for its next chunk.
            if self.max_num_batched_tokens < self.max_num_seqs:
                raise ValueError(
                    "SchedulerConfig.max_num_batched_tokens must be >= max_num_seqs, got "
                    f"{self.max_num_batched_tokens} < {self.max_num_seqs}"
                )
        # Without chunked prefill, the longest sequence must fit one step's budget.
        elif self.max_num_batched_tokens < max(self.max_model_len, self.max_num_seqs):
            raise ValueError(
                "SchedulerConfig.max_num_batched_tokens must be >= max(max_model_len, max_num_seqs), got "
                f"{self.max_num_batched_tokens} < max({self.max_model_len}, {self.max_num_seqs})"
            )


@dataclass(eq=False)
class PrefillJob:
    """Tokens to prefill once, then fork into `seqs` (n samples, or one preempted sample).

    num_shared_tokens: the leading tokens whose K/V already sat in the table's first blocks
    at admission, shared with a running sibling or found in the prefix cache; they are never
    computed or written (other sequences read them).
    num_computed: tokens whose K/V are in the cache (`finish_chunk` advances it).
    chunk_start, chunk_end: this step's chunk is `tokens[chunk_start:chunk_end]`; the job's
    samples start once a chunk reaches the end of `tokens`.
    """

    request: Request
    seqs: list[Sequence]
    tokens: list[int]
    table: BlockTable | None = None
    num_shared_tokens: int = 0
    num_computed: int = 0
    chunk_start: int = 0
    chunk_end: int = 0
    cache_root: int = ROOT_KEY  # the prefix cache's key chain its blocks go in (`Sequence.cache_root`)

    @property
    def chunk(self) -> list[int]:
        """This step's tokens."""
        return self.tokens[self.chunk_start : self.chunk_end]

    @property
    def is_last_chunk(self) -> bool:
        return self.chunk_end == len(self.tokens)


@dataclass
class SchedulerOutput:
    prefills: list[PrefillJob] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    # Per decoding sequence, the slots of the tokens it feeds this step: one, or up to
    # `num_steps` for a multi-step decode (fewer when its max_tokens or the context ends first).
    decode_slots: list[list[int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src block, dst block), run first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens of one model step: one per decoding sequence plus the prefill chunks."""
        return len(self.decodes) + sum(j.chunk_end - j.chunk_start for j in self.prefills)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Owns the waiting queue, the running list and the KV block tables."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: collections.deque[PrefillJob] = collections.deque()
        self.running: list[Sequence] = []
        # Admitted jobs whose prefill takes more steps (chunked prefill), oldest first.
        self.prefilling: list[PrefillJob] = []
        # Prompt tokens found in the prefix cache at admission, and prefill tokens computed.
        # (Tokens count what a hit spared; blocks count only the full ones taken as they are.)
        self.num_prefix_cache_hit_tokens = 0
        self.num_prefix_cache_hit_blocks = 0
        self.num_prefix_cache_partial_hit_tokens = 0  # of the hit tokens, those from partial blocks
        self.num_computed_prefill_tokens = 0
        self.num_preemptions = 0
        # Admissions made on the prompt's blocks alone because nothing ran (see the module docstring).
        self.num_forced_admissions = 0
        # Blocks that recomputes of preempted samples shared with a running sibling instead of copying.
        self.num_recompute_shared_blocks = 0
        self.watermark_blocks = int(config.watermark * kv.pool.num_blocks)
        self._next_seq_id = 0

    # -- admission ---------------------------------------------------------------
    def check_fits(self, prompt_len: int, n: int, max_tokens: int) -> None:
        """Raise ValueError when a request could never be scheduled."""
        if prompt_len < 1:
            raise ValueError("prompt must hold at least one token")
        if prompt_len >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {prompt_len} tokens; the context length is {self.config.max_model_len} "
                "(prompt must be shorter to leave room for one generated token)"
            )
        if n > self.config.max_num_seqs:
            raise ValueError(f"n={n} samples exceed max_num_seqs={self.config.max_num_seqs}")
        # Preemption frees everything else, so one sample alone must fit the pool.
        longest = min(prompt_len + max_tokens, self.config.max_model_len)
        need = self.kv.blocks_for(longest)
        if need > self.kv.pool.num_blocks:
            raise ValueError(
                f"KV pool of {self.kv.pool.num_blocks} blocks is too small for one sequence of "
                f"{longest} tokens (prompt {prompt_len} + max_tokens {max_tokens}; needs {need} blocks)"
            )

    def add(self, request: Request) -> None:
        self.check_fits(len(request.prompt), request.params.n, request.params.max_tokens)
        for i in range(request.params.n):
            seq = Sequence(self._next_seq_id, request, i, list(request.prompt), len(request.prompt))
            self._next_seq_id += 1
            request.sequences.append(seq)
        self.waiting.append(PrefillJob(request, list(request.sequences), list(request.prompt)))

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sample of `request_id` with ABORT and free its blocks."""
        aborted: list[Sequence] = []
        for job in list(self.waiting):
            if job.request.request_id == request_id:
                self.waiting.remove(job)
                aborted += job.seqs
        for job in [j for j in self.prefilling if j.request.request_id == request_id]:
            self.drop_prefilling(job)
            aborted += job.seqs
        for seq in [s for s in self.running if s.request.request_id == request_id]:
            aborted.append(seq)
        for seq in aborted:
            self.finish(seq, FinishReason.ABORT)
        return aborted

    def drop_prefilling(self, job: PrefillJob) -> None:
        """Stop a job in the middle of its prefill: free its blocks, forget its progress."""
        self.prefilling.remove(job)
        if job.table is not None:
            self.kv.free(job.table)
        job.table = None
        job.num_computed = job.chunk_start = job.chunk_end = job.num_shared_tokens = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.prefilling)

    # -- one step ----------------------------------------------------------------
    def schedule(self, *, admit_new: bool = True, num_steps: int = 1) -> SchedulerOutput:
        """Plan one step. `admit_new=False` resumes only preempted samples (no fresh request starts).

        `num_steps > 1` asks for a multi-step decode: each running sequence gets the slots of
        up to `num_steps` tokens at once (capped by its max_tokens and the context), when the
        pool holds the blocks for all of them; otherwise the step is a single decode step,
        with preemption if needed.
        """
        out = SchedulerOutput()
        if not self._reserve_decode_slots(out, num_steps):
            self._schedule_decodes(out)
        if not out.preempted:
            self._schedule_prefills(out, admit_new=admit_new)
        return out

    def _reserve_decode_slots(self, out: SchedulerOutput, num_steps: int) -> bool:
        """Reserve up to `num_steps` slots per running sequence (capped by its max_tokens and the
        context) when the pool holds all the blocks they need; False, with nothing reserved, if not."""
        kv, max_len = self.kv, self.config.max_model_len
        counts = [
            min(num_steps, s.request.params.max_tokens - s.num_generated, max_len - len(s.tokens))
            for s in self.running
        ]
        # n appends take at most ceil((n - 1) / block_size) new blocks plus one copy-on-write:
        # when even that fits for everyone (the usual case) the exact count is not needed.
        most = -(-(num_steps - 1) // kv.block_size) + 1
        if kv.num_free < most * len(self.running):
            need = sum(
                kv.blocks_needed_to_append(s.kv_table, n) for s, n in zip(self.running, counts, strict=True)
            )
            if need > kv.num_free:
                return False
        for seq, n in zip(self.running, counts, strict=True):
            slots, copies = kv.append_slots(seq.kv_table, n)
            out.copies.extend(copies)
            out.decode_slots.append(slots)
        out.decodes.extend(self.running)
        return True

    def _schedule_decodes(self, out: SchedulerOutput) -> None:
        """One decode step for the running sequences the pool can hold, preempting the newest."""
        kv = self.kv
        queue = collections.deque(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            assert seq.table is not None
            preempted_self = False
            while kv.blocks_needed_to_append(seq.table) > kv.num_free:
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            slot = kv.append_slot(seq.table)
            if slot.copy_from is not None:
                out.copies.append((slot.copy_from, slot.copy_to))  # type: ignore[arg-type]
            out.decodes.append(seq)
            out.decode_slots.append([slot.slot])
            kept.append(seq)
        self.running = kept
        # Preempted samples go back to the head of the queue, oldest first.
        out.preempted.sort(key=lambda s: (s.request.arrival, s.sample_index))
        for seq in reversed(out.preempted):
            self.waiting.appendleft(PrefillJob(seq.request, [seq], list(seq.tokens)))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        assert seq.table is not None
        # Its computed K/V stay cached (unreferenced, evicted only when the pool needs them):
        # its recompute then takes whatever survived instead of computing it again.
        self.kv.cache_computed_blocks(seq.table, seq.tokens, len(seq.tokens) - 1, seq.cache_root)
        self.kv.free(seq.table)
        seq.table = None
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """Tokens of a job this step: all that remain without chunked prefill, else what the
        budget and the chunk size allow."""
        if not self.config.chunked_prefill:
            return remaining
        return min(remaining, budget, self.config.prefill_chunk_size or budget)

    def _schedule_prefills(self, out: SchedulerOutput, *, admit_new: bool) -> None:
        kv = self.kv
        budget = self.config.max_num_batched_tokens - len(out.decodes)
        # Jobs in the middle of their prefill go first: they hold their blocks already.
        for job in self.prefilling:
            size = self._chunk_size(len(job.tokens) - job.num_computed, budget)
            if size < 1:
                break
            job.chunk_start, job.chunk_end = job.num_computed, job.num_computed + size
            budget -= size
            self.num_computed_prefill_tokens += size
            out.prefills.append(job)
        if not self.waiting:
            return
        num_running = len(self.running) + sum(len(j.seqs) for j in self.prefilling)
        reserved = next_decode_blocks(self.kv, out, self.config.max_model_len) + sum(
            first_decode_blocks(len(j.tokens), len(j.seqs), self.kv.block_size) for j in self.prefilling
        )
        while self.waiting:
            job = self.waiting[0]
            if not admit_new and job.seqs[0].num_generated == 0:
                break
            sibling = live_prompt_blocks(job, self.kv.block_size, kv.root)
            hit = kv.prefix_hit(job.tokens, stale_ok=job.request.reuse_stale_kv)
            from_cache = hit.num_tokens(kv.block_size) > sibling.num_tokens(kv.block_size)
            if not from_cache:
                hit = sibling
            num_shared = hit.num_tokens(kv.block_size)
            alloc = kv.blocks_to_allocate_hit(len(job.tokens), hit)
            next_step = first_decode_blocks(len(job.tokens), len(job.seqs), self.kv.block_size)
            fits = alloc + next_step + reserved + self.watermark_blocks <= kv.num_free
            # Liveness: with nothing running or admitted, the head only needs its prompt's blocks.
            forced = (
                not fits
                and not self.running
                and not self.prefilling
                and not out.prefills
                and alloc <= kv.num_free
            )
            remaining = len(job.tokens) - num_shared
            size = self._chunk_size(remaining, budget)
            if (
                size < 1
                or size > budget
                or num_running + len(job.seqs) > self.config.max_num_seqs
                or not (fits or forced)
            ):
                break  # strict FIFO: nothing overtakes the head of the queue
            self.waiting.popleft()
            allocation = kv.allocate_hit(len(job.tokens), hit)
            job.table = allocation.table
            if allocation.copy is not None:
                out.copies.append(allocation.copy)  # the step copies before it writes
            job.num_shared_tokens = job.num_computed = num_shared
            job.cache_root = hit.root
            job.chunk_start, job.chunk_end = job.num_computed, job.num_computed + size
            self.num_forced_admissions += int(forced)
            if from_cache:
                self.num_prefix_cache_hit_blocks += len(hit.blocks)
                self.num_prefix_cache_hit_tokens += num_shared
                self.num_prefix_cache_partial_hit_tokens += hit.partial_tokens
            else:
                self.num_recompute_shared_blocks += len(hit.blocks)
            if job.request.num_cached_tokens is None:  # its first admission (not a recompute)
                job.request.num_cached_tokens = num_shared if from_cache else 0
            self.num_computed_prefill_tokens += size
            budget -= size
            num_running += len(job.seqs)
            reserved += next_step
            self.prefilling.append(job)
            out.prefills.append(job)

    # -- results of a step -------------------------------------------------------
    def finish_chunk(self, job: PrefillJob) -> bool:
        """After this step's chunk of `job` ran: key its full blocks in the prefix cache and, when
        the prefill is complete, start its samples (`start_running`). True when it completed."""
        assert job.table is not None
        job.num_computed = job.chunk_end
        self.kv.cache_full_blocks(job.table, job.tokens, job.num_computed, job.cache_root)
        if job.num_computed < len(job.tokens):
            return False
        self.start_running(job)
        return True

    def start_running(self, job: PrefillJob) -> None:
        """After `job`'s prefill ran: give each of its samples a table (shared blocks) and run it."""
        assert job.table is not None
        if job in self.prefilling:
            self.prefilling.remove(job)
        for i, seq in enumerate(job.seqs):
            seq.table = job.table if i == 0 else self.kv.fork(job.table)
            seq.cache_root = job.cache_root
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self.running.sort(key=lambda s: (s.request.arrival, s.sample_index))

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.table is not None:
            if reason is not FinishReason.ABORT and seq.status is SequenceStatus.RUNNING:
                # Key the blocks of what it generated too, the partly filled last one included
                # (every token but the last, whose K/V were never computed): the next turn of a
                # multi-turn trajectory continues this very sequence, and its prefill then
                # starts from these blocks and computes only the new tokens.
                self.kv.cache_computed_blocks(seq.table, seq.tokens, len(seq.tokens) - 1, seq.cache_root)
            self.kv.free(seq.table)
            seq.table = None
        if seq in self.running:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def finish_many(self, seqs: Iterable[Sequence], reason: FinishReason) -> None:
        for seq in list(seqs):
            self.finish(seq, reason)


# -- block accounting of admission ------------------------------------------------
def next_decode_blocks(kv: KVCacheManager, out: SchedulerOutput, max_model_len: int) -> int:
    """Blocks the next step's decode token of every running sequence in `out` will take.

    An upper bound: a shared tail counts once per sharer (its last sharer writes in place),
    and a sample may stop early on EOS. A sequence whose tokens of this step reach its
    max_tokens or the context finishes in this step and needs nothing more.
    """
    return sum(
        kv.blocks_needed_to_append(seq.kv_table)
        for seq, slots in zip(out.decodes, out.decode_slots, strict=True)
        if seq.num_generated + len(slots) < seq.request.params.max_tokens
        and len(seq.tokens) + len(slots) < max_model_len
    )


def first_decode_blocks(num_tokens: int, n: int, block_size: int) -> int:
    """Blocks the first decode step of a job's `n` samples takes after a prefill of `num_tokens`.

    The samples share every prompt block. A partly filled last block is copied for each
    sample but the last to write (which then owns it): n - 1 copies. A full last block
    leaves each sample to start a new one: n blocks.
    """
    return n if num_tokens % block_size == 0 else n - 1


def live_prompt_blocks(job: PrefillJob, block_size: int, root: int) -> PrefixHit:
    """The full prompt blocks a preempted sample can share with a running sibling (none: in
    the chain from `root`), in the sibling's key chain.

    Full prompt blocks are never written after the group's prefill (copy-on-write only ever
    copies a partly filled last block), so a running sibling's first `prompt_len // block_size`
    blocks hold exactly the K/V the recompute would produce. Only running siblings count:
    their K/V are already in the cache, whatever order this step's prefills run in.
    """
    if len(job.seqs) != 1 or job.seqs[0].num_generated == 0:
        return PrefixHit(root=root)  # a fresh group: nothing of it is in the cache yet
    seq = job.seqs[0]
    for sibling in seq.request.sequences:
        if sibling is not seq and sibling.status is SequenceStatus.RUNNING and sibling.table is not None:
            return PrefixHit(sibling.table.blocks[: seq.prompt_len // block_size], root=sibling.cache_root)
    return PrefixHit(root=root)
