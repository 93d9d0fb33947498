"""Trim a padded batch to its real length, rounded up to a bucket.

Batches usually arrive padded to the model's max_seq_len, but the trainer's memory and
compute grow with the padded length (activations linearly, attention scores
quadratically), so the update runs on the longest real sequence rounded up to a bucket:
a few buckets per doubling keep the padding waste under 25% while bounding the number of
compiled programs to about 4 * log2(max_seq_len).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bucketed_length", "real_length", "trim_to_bucket"]


def bucketed_length(n: int, *, min_bucket: int = 16, per_octave: int = 4) -> int:
    """Smallest bucket >= n: `min_bucket`, then `per_octave` evenly spaced lengths in each
    (2**(k-1), 2**k] (multiples of 2**k / (2 * per_octave)).

    e.g. with the defaults: 16, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, ... 256, 320, ...
    """
    if n < 1:
        raise ValueError(f"length must be >= 1, got {n}")
    if n <= min_bucket:
        return min_bucket
    top = 1 << (n - 1).bit_length()  # smallest power of two >= n
    step = max(top // (2 * per_octave), 1)
    return -(-n // step) * step


def real_length(valid: np.ndarray, mask: np.ndarray | None = None) -> int:
    """1 + the last column any row uses: valid [B, S] bool; mask [B, S-1] (index t scores token t+1)."""
    cols = np.flatnonzero(np.asarray(valid).any(axis=0))
    n = int(cols[-1]) + 1 if cols.size else 1
    if mask is not None:
        scored = np.flatnonzero((np.asarray(mask) != 0).any(axis=0))
        if scored.size:
            n = max(n, int(scored[-1]) + 2)
    return max(n, 2)


def trim_to_bucket(arrays: dict[str, np.ndarray], **bucket_kw: int) -> dict[str, np.ndarray]:
    """The batch's per-position arrays cut to `bucketed_length(real length)` columns (never longer
    than they were). tokens/valid: [B, S] -> [B, S']; mask/worker_logprobs: [B, S-1] -> [B, S'-1];
    per-row arrays unchanged. Only padding is removed: causal attention means no kept position
    ever attended to a removed one, so the update is the same.
    """
    s = arrays["tokens"].shape[1]
    keep = min(bucketed_length(real_length(arrays["valid"], arrays.get("mask")), **bucket_kw), s)
    if keep == s:
        return dict(arrays)
    out = {}
    for k, v in arrays.items():
        if v.ndim == 2 and v.shape[1] == s:
            out[k] = v[:, :keep]
        elif v.ndim == 2 and v.shape[1] == s - 1:
            out[k] = v[:, : keep - 1]
        else:
            out[k] = v
    return out
