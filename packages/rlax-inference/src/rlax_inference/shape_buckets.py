"""Padded sizes of the engine's programs: every array dimension that varies at run time is
rounded up to a bucket, so a bounded set of programs serves every request."""

from __future__ import annotations

__all__ = ["bucket", "buckets_up_to"]


def buckets_up_to(minimum: int, upto: int, maximum: int) -> list[int]:
    """Every `bucket(n, minimum, maximum)` for n in 1..upto, ascending (none when upto < 1)."""
    if upto < 1:
        return []
    top = bucket(min(upto, maximum), minimum, maximum)
    found, size = [], minimum
    while size < top:
        found.append(size)
        size *= 2
    return [*found, top]


def bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power-of-two multiple of `minimum` >= n, capped at `maximum` (n must fit)."""
    if n > maximum:
        raise ValueError(f"size {n} exceeds the largest bucket {maximum}")
    b = minimum
    while b < n:
        b *= 2
    return min(b, maximum)
