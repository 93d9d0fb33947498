"""Pack a minibatch's rollouts into rows of real tokens, sharing each group's common prefix.

A GRPO batch is mostly padding and repeated prompts: the G samples of a prompt repeat its
tokens G times, and every row is padded to the longest one. Packing lays the tokens of a
minibatch out again so that the model runs only on what it has to:

- the samples of one prompt group share one copy of their longest common prefix (the
  prompt, and any opening tokens all samples agree on): causal attention makes the hidden
  states of a common prefix the same in every sample, so computing them once gives the
  same values, and the gradient through them is the sum over the samples (backpropagation
  adds the same terms in another order);
- each sample's remaining tokens form a segment that attends to itself (causally) and to
  its prefix copy, never across samples;
- prefix copies and segments are placed first-fit into rows of `length` tokens; a group
  whose samples do not fit one row continues in another with its own prefix copy.

The model then runs one packed row per forward/backward pass, as many passes as rows are
used (`rows_used`), and each sample's log-probs are gathered back into the padded row
layout (`source`) that the objective works on, so no objective changes.

Shapes (M minibatches of b rollouts, rows padded to S tokens, packed rows of L tokens; a
minibatch never needs more than b rows, one per sample):

    tokens, segment, parent, positions   [M, R, L] int32  (R = b, or 1 when one row holds
                                                           every minibatch: `best_layout`)
    rows_used                            [M] int32
    seq_row                              [M, b] int32   packed row of each sample
    source                               [M, b, S-1] int32
        index in its packed row of the hidden state that predicts token t+1 of the sample
        (0 where t+1 is padding: those positions are never scored)

`segment` is 0 on padding and a positive id per prefix copy or sample segment; `parent` is
the prefix copy a segment token may also attend to (itself for prefix tokens).

Batch-invariant packing (`align` = `rlax_model.attention.KEY_BLOCK`): the attention reduces
its keys in blocks of that many, aligned to the row's start, and adds the blocks in order
(`rlax_model.dense_attention_reference`). A rollout's keys then meet the same blocks, with
the same contents, as in its own padded row exactly when every key's row index equals its
position modulo the block: each prefix copy and segment starts at a multiple of `align`
and the shared prefix is cut to a multiple of it (its remainder is computed in each
sample's segment). Its log-probs are then bitwise those of the padded pass, whatever else
is packed with it; the cost is the alignment's padding and the shorter shared prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["PackedLayout", "best_layout", "candidate_lengths", "pack_minibatches"]


class PackedLayout(NamedTuple):
    tokens: np.ndarray
    segment: np.ndarray
    parent: np.ndarray
    positions: np.ndarray
    rows_used: np.ndarray
    seq_row: np.ndarray
    source: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        """The layout as the update's input arrays (`pk_` prefixed names)."""
        return {f"pk_{k}": v for k, v in self._asdict().items()}

    @property
    def computed_tokens(self) -> int:
        """Token positions the packed passes compute: rows used x row length."""
        return int(self.rows_used.sum()) * int(self.tokens.shape[-1])


def candidate_lengths(seq_len: int) -> list[int]:
    """Row lengths to choose from when the config leaves `pack_length` at 0: half, once and
    twice the padded length S (the half at least 64 tokens). A batch of short samples packs
    into short rows, one of long samples shares a prefix among several of them in long rows;
    each length is one compiled program. At S = 128 on SmolLM2 a 256-token row spends ~8% of
    a pass's FLOPs on attention across its segments."""
    return sorted({max(seq_len // 2, min(64, seq_len)), seq_len, 2 * seq_len})


def best_layout(
    tokens: np.ndarray, valid: np.ndarray, order: np.ndarray, minibatches: int, group_size: int,
    lengths: list[int], align: int = 1,
) -> PackedLayout:  # fmt: skip
    """The layout, over the row `lengths` that hold the batch's longest rollout, that computes
    the fewest positions; on a tie the one with the fewest rows per minibatch, then the
    shorter row (less attention). `align`: see the module docstring (1: no alignment).

    Fewer rows first: two rows of S compute as many positions as one of 2S, but a minibatch
    of several rows runs the accumulating program, which holds a second buffer of gradients
    (SmolLM2-135M: +356 MiB of XLA temporaries, 1,382 vs 1,026 MiB, the trainer's peak)."""
    longest = int(np.asarray(valid).sum(axis=1).max())
    fits = [n for n in sorted(lengths) if n >= longest]
    if not fits:
        raise ValueError(f"a rollout has {longest} tokens, more than the longest packed row {max(lengths)}")
    layouts = [pack_minibatches(tokens, valid, order, minibatches, group_size, n, align) for n in fits]
    best = min(layouts, key=lambda lay: (lay.computed_tokens, int(lay.rows_used.max())))  # first: shortest
    if best.rows_used.max() == 1:
        # Every minibatch fits one row: keep only it, so that the update runs one pass with
        # no gradient accumulator (a program of its own: one buffer of gradients, not two).
        best = best._replace(
            **{k: getattr(best, k)[:, :1] for k in ("tokens", "segment", "parent", "positions")}
        )
    return best


def _common_prefix(rows: list[np.ndarray]) -> int:
    """Length of the longest prefix all `rows` share, leaving each at least one own token."""
    head = np.stack([r[: min(len(r) for r in rows) - 1] for r in rows])  # [members, shortest-1]
    differs = np.flatnonzero((head != head[0]).any(axis=0))
    return int(differs[0]) if differs.size else head.shape[1]


def _pack_one(
    tokens: np.ndarray, lengths: np.ndarray, group_of: np.ndarray, length: int, align: int
) -> tuple[np.ndarray | np.int32, ...]:
    """One minibatch: tokens [b, S], lengths [b], group_of [b] -> its layout arrays."""
    b, s = tokens.shape
    if lengths.max() > length:
        raise ValueError(f"a rollout has {lengths.max()} tokens, more than the packed row length {length}")
    out_tok = np.zeros((b, length), np.int32)
    out_seg = np.zeros((b, length), np.int32)
    out_par = np.zeros((b, length), np.int32)
    out_pos = np.zeros((b, length), np.int32)
    seq_row = np.zeros((b,), np.int32)
    source = np.zeros((b, s - 1), np.int32)
    fill: list[int] = []  # tokens used in each open row
    next_id: list[int] = []  # next segment id in each row

    def first_free(r: int) -> int:
        return -(-fill[r] // align) * align

    def place(n: int) -> int:
        """The first row with room for n tokens (a new one if none)."""
        for r in range(len(fill)):
            if first_free(r) + n <= length:
                return r
        fill.append(0)
        next_id.append(1)
        return len(fill) - 1

    def put(r: int, toks: np.ndarray, first_pos: int, parent: int | None) -> tuple[int, int]:
        """Write a segment into row r; -> (its start index, its id)."""
        start, sid = first_free(r), next_id[r]
        end = start + len(toks)
        out_tok[r, start:end] = toks
        out_seg[r, start:end] = sid
        out_par[r, start:end] = sid if parent is None else parent
        out_pos[r, start:end] = np.arange(first_pos, first_pos + len(toks))
        fill[r], next_id[r] = end, sid + 1
        return start, sid

    groups: dict[int, list[int]] = {}
    for j in range(b):
        groups.setdefault(int(group_of[j]), []).append(j)
    for members in groups.values():
        seqs = [tokens[j, : lengths[j]] for j in members]
        p = _common_prefix(seqs) // align * align
        row, prefix_start, prefix_id = -1, 0, 0
        for j, seq in zip(members, seqs, strict=True):
            own = seq[p:]
            if row < 0 or first_free(row) + len(own) > length:
                row = place(p + len(own))
                if p:
                    prefix_start, prefix_id = put(row, seq[:p], 0, None)
            start, sid = put(row, own, p, prefix_id if p else None)
            seq_row[j] = row
            # Hidden state at sample position t (prefix copy when t < p, else its segment)
            # predicts token t+1: the row layout's index t.
            t = np.arange(lengths[j] - 1)
            source[j, : lengths[j] - 1] = np.where(t < p, prefix_start + t, start + t - p)
    return out_tok, out_seg, out_par, out_pos, np.int32(len(fill)), seq_row, source


def pack_minibatches(
    tokens: np.ndarray, valid: np.ndarray, order: np.ndarray, minibatches: int, group_size: int, length: int,
    align: int = 1,
) -> PackedLayout:  # fmt: skip
    """tokens [B, S] int, valid [B, S] bool (each row's real tokens a prefix of it), order [B]
    (row r of the batch goes to position r of the minibatch sequence: minibatch m takes
    order[m*b:(m+1)*b]) -> the PackedLayout of every minibatch, samples in `order`.
    align: every prefix copy and segment starts at a multiple of it, and shared prefixes
    are cut to a multiple of it (see the module docstring; 1: none)."""
    b_total, _ = tokens.shape
    b = b_total // minibatches
    lengths = valid.sum(axis=1).astype(np.int64)
    if np.any(valid != (np.arange(valid.shape[1])[None, :] < lengths[:, None])):
        raise ValueError("packing needs each row's real tokens first (right padding)")
    if lengths.min() < 2:
        raise ValueError("packing needs rollouts of at least 2 tokens")
    parts = []
    for m in range(minibatches):
        rows = np.asarray(order[m * b : (m + 1) * b])
        parts.append(_pack_one(tokens[rows], lengths[rows], rows // group_size, length, align))
    return PackedLayout(*(np.stack([p[i] for p in parts]) for i in range(7)))
