"""Exact duplicates (hash of the normalised text) and near-duplicates (MinHash LSH).

Near-duplicate means: the same problem, worded a little differently. Two records are
compared only when their answer keys (numbers, operators, symbols and variables, in
order; see `answer_key`) are identical; among those, MinHash LSH over word shingles of
the wording decides. So "3x+5=11" and "3x+5=17", or two Countdown prompts that differ
only in the target, are never merged however alike their text is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
from datasketch import MinHash, MinHashLSH

from rlax_data.curation.text import answer_key, normalize_text, prose_words, record_text
from rlax_data.datasets import Record

__all__ = ["DedupConfig", "DedupReport", "deduplicate"]


class DedupConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """threshold: Jaccard similarity (of `shingle`-word shingles of the wording) above
    which two records with the same answer key are near-duplicates; num_perm: MinHash
    permutations; seed: MinHash seed. near: also remove near-duplicates (else only
    exact ones)."""

    threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 3
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


def _digest(parts: Sequence[str]) -> bytes:
    # Tokens joined by a separator no token contains, so ("1 2",) and ("1", "2") differ.
    return hashlib.blake2b("\x00".join(parts).encode("utf-8"), digest_size=16).digest()


def _wording_minhash(text: str, cfg: DedupConfig) -> MinHash | None:
    """MinHash of the wording's word shingles; None when the text has no wording."""
    words = prose_words(text)
    if not words:
        return None
    n = min(cfg.shingle, len(words))
    grams = sorted({" ".join(words[i : i + n]) for i in range(len(words) - n + 1)})
    m = MinHash(num_perm=cfg.num_perm, seed=cfg.seed)
    m.update_batch([g.encode("utf-8") for g in grams])
    return m


def _near_duplicates(
    records: Sequence[Record], unique: list[int], cfg: DedupConfig
) -> tuple[list[int], list[tuple[str, str, float]]]:
    """(kept indices, near pairs) among `unique`, comparing only records with one answer key."""
    by_key: dict[bytes, list[int]] = {}
    for i in unique:
        by_key.setdefault(_digest(answer_key(record_text(records[i]))), []).append(i)
    dropped: set[int] = set()
    pairs: list[tuple[int, tuple[str, str, float]]] = []
    for members in by_key.values():
        if len(members) < 2:
            continue  # a problem of its own: nothing to compare with
        lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm)
        hashes: dict[str, MinHash] = {}
        for i in members:
            m = _wording_minhash(record_text(records[i]), cfg)
            if m is None:
                continue  # no wording: only an exact duplicate could match, handled before
            # LSH candidates are only likely matches: confirm with the estimated Jaccard.
            best = max(((hashes[h].jaccard(m), h) for h in lsh.query(m)), default=(0.0, ""))
            if best[0] >= cfg.threshold:
                pairs.append((i, (records[int(best[1])].id, records[i].id, round(best[0], 4))))
                dropped.add(i)
                continue
            lsh.insert(str(i), m)
            hashes[str(i)] = m
    # Report in input order, as if the groups had been scanned together.
    return [i for i in unique if i not in dropped], [pair for _, pair in sorted(pairs)]


def deduplicate(
    records: Sequence[Record], config: DedupConfig | None = None
) -> tuple[list[Record], DedupReport]:
    """Drop exact then near duplicates, keeping the first occurrence in input order."""
    cfg = config or DedupConfig()
    first_of: dict[bytes, int] = {}
    groups: dict[int, list[str]] = {}
    unique: list[int] = []
    for i, r in enumerate(records):
        h = _digest([normalize_text(record_text(r))])
        if h in first_of:
            groups.setdefault(first_of[h], [records[first_of[h]].id]).append(r.id)
        else:
            first_of[h] = i
            unique.append(i)
    removed = [rid for g in groups.values() for rid in g[1:]]
    near_pairs: list[tuple[str, str, float]] = []
    kept_idx = unique
    if cfg.near:
        kept_idx, near_pairs = _near_duplicates(records, unique, cfg)
        removed.extend(b for _, b, _ in near_pairs)
    kept = [records[i] for i in kept_idx]
    report = DedupReport(
        total=len(records),
        kept=len(kept),
        exact_groups=list(groups.values()),
        near_pairs=near_pairs,
        removed=removed,
    )
    return kept, report
