"""Exact duplicates (hash of the normalised text) and near-duplicates (MinHash LSH)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
from datasketch import MinHash, MinHashLSH

from rlax_data.curation.text import normalize_text, record_text, shingles
from rlax_data.datasets import Record

__all__ = ["DedupConfig", "DedupReport", "deduplicate"]


class DedupConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """threshold: Jaccard similarity (of `shingle`-character shingles) above which two
    records are near-duplicates; num_perm: MinHash permutations; seed: MinHash seed.
    near: also remove near-duplicates (else only exact ones)."""

    threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 5
    seed: int = 1
    near: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"field `threshold`: must be in (0, 1), got {self.threshold}")
        if self.num_perm < 16:
            raise ValueError(f"field `num_perm`: must be >= 16, got {self.num_perm}")
        if self.shingle < 1:
            raise ValueError(f"field `shingle`: must be >= 1, got {self.shingle}")


class DedupReport(msgspec.Struct, kw_only=True):
    """exact_groups: ids sharing one normalised text (first id kept). near_pairs:
    (kept id, removed id, estimated Jaccard). removed: every removed id."""

    total: int
    kept: int
    exact_groups: list[list[str]]
    near_pairs: list[tuple[str, str, float]]
    removed: list[str]


def _minhash(text: str, cfg: DedupConfig) -> MinHash:
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    m.update_batch([sh.encode("utf-8") for sh in sorted(shingles(text, cfg.shingle))])
    return m


def deduplicate(
    records: Sequence[Record], config: DedupConfig | None = None
) -> tuple[list[Record], DedupReport]:
    """Drop exact then near duplicates, keeping the first occurrence in input order."""
    cfg = config or DedupConfig()
    first_of: dict[bytes, int] = {}
    groups: dict[int, list[str]] = {}
    unique: list[int] = []
    for i, r in enumerate(records):
        h = hashlib.blake2b(normalize_text(record_text(r)).encode("utf-8"), digest_size=16).digest()
        if h in first_of:
            groups.setdefault(first_of[h], [records[first_of[h]].id]).append(r.id)
        else:
            first_of[h] = i
            unique.append(i)
    removed = [rid for g in groups.values() for rid in g[1:]]
    near_pairs: list[tuple[str, str, float]] = []
    kept_idx = unique
    if cfg.near:
        lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
        kept_idx = []
        hashes: dict[str, MinHash] = {}
        for i in unique:
            r = records[i]
            m = _minhash(record_text(r), cfg)
            hits = lsh.query(m)
            # LSH candidates are only likely matches: confirm with the estimated Jaccard.
            best = max(((hashes[h].jaccard(m), h) for h in hits), default=(0.0, ""))
            if best[0] >= cfg.threshold:
                near_pairs.append((best[1], r.id, round(best[0], 4)))
                removed.append(r.id)
                continue
            key = str(i)
            lsh.insert(key, m)
            hashes[key] = m
            kept_idx.append(i)
        near_pairs = [(records[int(a)].id, b, s) for a, b, s in near_pairs]
    kept = [records[i] for i in kept_idx]
    report = DedupReport(
        total=len(records),
        kept=len(kept),
        exact_groups=list(groups.values()),
        near_pairs=near_pairs,
        removed=removed,
    )
    return kept, report
