"""A pure-Python stand-in for the model runner that really reads and writes a paged cache.

Each physical slot holds the token id whose K/V would live there. The "model" sees a
sequence's context only through its block table, so a bookkeeping bug (a shared block
written by two samples, a lost copy-on-write, a freed block still in use) changes the
tokens it produces.
"""

from __future__ import annotations

import zlib

from rlax_inference.block_pool import NULL_BLOCK
from rlax_inference.scheduler import Scheduler, SchedulerOutput
from rlax_inference.sequence import FinishReason, Request, Sequence, SequenceStatus

VOCAB = 50


def next_token(context: list[int], sample_index: int) -> int:
    data = bytes(str((context, sample_index)), "ascii")
    return zlib.crc32(data) % VOCAB


def reference_completion(prompt: list[int], sample_index: int, max_tokens: int, max_len: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_len:
        tokens.append(next_token(tokens, sample_index))
    return tokens[len(prompt) :]


class PagedFakeRunner:
    def __init__(self, scheduler: Scheduler, num_steps: int = 1) -> None:
        self.scheduler = scheduler
        self.num_steps = num_steps
        self.block_size = scheduler.kv.block_size
        self.cache: dict[int, int] = {}
        self.shared_tokens_read = 0  # prefill tokens found already in blocks shared with a sibling

    def _read(self, seq_blocks: list[int], n: int) -> list[int]:
        bs = self.block_size
        assert NULL_BLOCK not in seq_blocks
        return [self.cache[seq_blocks[i // bs] * bs + i % bs] for i in range(n)]

    def step(self) -> SchedulerOutput:
        sched = self.scheduler
        out = sched.schedule(num_steps=self.num_steps)
        bs = self.block_size
        for src, dst in out.copies:
            for o in range(bs):
                if src * bs + o in self.cache:
                    self.cache[dst * bs + o] = self.cache[src * bs + o]
        # Freed blocks lose their contents, so reading one later fails loudly.
        live = {b for s in sched.running for b in (s.table.blocks if s.table else [])}
        live |= {b for j in sched.prefilling for b in (j.table.blocks if j.table else [])}
        # Prefix-cached blocks keep their K/V after their last reader lets go.
        live |= set(sched.kv.pool._key_of)
        self.cache = {k: v for k, v in self.cache.items() if k // bs in live}
        for seq, slots in zip(out.decodes, out.decode_slots):
            for slot in slots:
                if seq.status is SequenceStatus.FINISHED:
                    break  # stopped inside a multi-step decode: the remaining slots go unused
                self.cache[slot] = seq.tokens[-1]
                ctx = self._read(seq.table.blocks, len(seq.tokens))
                self._append(seq, next_token(ctx, seq.sample_index))
        for job in out.prefills:
            if job.chunk_start == job.num_shared_tokens:  # the first chunk: check what it reuses
                for i in range(job.num_shared_tokens):
                    # Shared with a sibling or the prefix cache: already written, and must hold this very token.
                    slot = job.table.blocks[i // bs] * bs + i % bs
                    assert self.cache[slot] == job.tokens[i], (slot, self.cache.get(slot), job.tokens[i])
                    self.shared_tokens_read += 1
            for i in range(job.chunk_start, job.chunk_end):
                # Earlier tokens must already be in the cache (chunks run in order).
                assert all(
                    self.cache.get(job.table.blocks[t // bs] * bs + t % bs) == job.tokens[t] for t in range(i)
                )
                self.cache[job.table.blocks[i // bs] * bs + i % bs] = job.tokens[i]
            if not sched.finish_chunk(job):
                continue
            for seq in job.seqs:
                ctx = self._read(seq.table.blocks, len(job.tokens))
                self._append(seq, next_token(ctx, seq.sample_index))
        return out

    def _append(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        p = seq.request.params
        if seq.num_generated >= p.max_tokens or len(seq.tokens) >= self.scheduler.config.max_model_len:
            self.scheduler.finish(seq, FinishReason.LENGTH)


def run_to_completion(runner: PagedFakeRunner, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not runner.scheduler.has_unfinished:
            return
        runner.step()
    raise AssertionError("scheduler did not drain")


def expected(req: Request, max_len: int) -> list[list[int]]:
    return [reference_completion(req.prompt, i, req.params.max_tokens, max_len) for i in range(req.params.n)]


def check_unaborted_outputs(requests: list[Request], max_len: int) -> int:
    """Assert that every request none of whose samples was aborted generated the reference
    completions; returns how many were checked."""
    checked = 0
    for r in requests:
        if any(s.finish_reason is FinishReason.ABORT for s in r.sequences):
            continue
        assert [s.output_tokens for s in r.sequences] == expected(r, max_len)
        checked += 1
    return checked
