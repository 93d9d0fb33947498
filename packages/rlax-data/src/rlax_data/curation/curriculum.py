"""Difficulty buckets for a curriculum, from pass rates (easiest bucket first)."""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from rlax_data.datasets import Record
from rlax_data.stream import StreamSource

__all__ = ["bucket_sources", "difficulty_buckets"]


def difficulty_buckets(
    records: Sequence[Record],
    *,
    edges: Sequence[float] = (0.25, 0.5, 0.75),
    pass_rates: Mapping[str, float] | None = None,
) -> dict[str, list[Record]]:
    """Group records by pass rate into buckets split at `edges`, easiest (highest pass
    rate) first; names look like "[0.50, 0.75)". Rates come from `pass_rates` (by id) or
    each record's `metadata["pass_rate"]` (set by the pre-filter); a record with neither
    is an error."""
    e = list(edges)
    if e != sorted(e) or len(set(e)) != len(e) or not all(0.0 < x < 1.0 for x in e):
        raise ValueError(f"edges: must be strictly increasing values in (0, 1), got {e}")
    bounds = [0.0, *e, 1.0]
    names = [f"[{lo:.2f}, {hi:.2f}{']' if hi == 1.0 else ')'}" for lo, hi in zip(bounds, bounds[1:])]
    buckets: dict[str, list[Record]] = {n: [] for n in names}
    for r in records:
        rate = pass_rates.get(r.id) if pass_rates is not None else r.metadata.get("pass_rate")
        if rate is None:
            raise ValueError(
                f"record {r.id!r}: no pass rate (metadata field `pass_rate` or `pass_rates[id]`)"
            )
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"record {r.id!r}: pass rate {rate} is outside [0, 1]")
        buckets[names[bisect.bisect_right(e, rate)]].append(r)
    return dict(reversed(list(buckets.items())))


def bucket_sources(
    buckets: Mapping[str, Sequence[Record]],
    weights: Mapping[str, float] | None = None,
    *,
    epochs: int | None = None,
) -> list[StreamSource]:
    """Stream sources from difficulty buckets (empty ones skipped), for a `PromptStream`
    whose mixture weights set the curriculum; buckets not in `weights` get weight 1."""
    w = weights or {}
    unknown = set(w) - set(buckets)
    if unknown:
        raise ValueError(f"weights: names no bucket: {sorted(unknown)} (buckets: {list(buckets)})")
    return [
        StreamSource(name, list(recs), weight=w.get(name, 1.0), epochs=epochs)
        for name, recs in buckets.items()
        if recs
    ]
