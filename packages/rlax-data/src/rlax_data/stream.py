"""A deterministic, resumable, weighted mixture of datasets.

Each draw picks a source with probability proportional to its weight among the
sources still active, then takes that source's next record in its current epoch's
shuffled order. Both choices come from counter-based randomness (a seeded hash of
(seed, step) or (seed, source, epoch)), so the whole state is a handful of integers:
the step counter and each source's (epoch, position). `state_dict()` is a small
JSON-able dict; `load_state_dict()` resumes exactly, and the sequence after a resume
equals the sequence of an uninterrupted stream.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlax_data.datasets import Record

__all__ = ["PromptStream", "StreamSource"]

_STATE_VERSION = 1


@dataclass(frozen=True)
class StreamSource:
    """name: unique key in the state. weight: relative sampling weight (> 0).
    epochs: passes over the source before it leaves the mixture (None: forever)."""

    name: str
    records: Sequence[Record]
    weight: float = 1.0
    epochs: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("field `name`: must be non-empty")
        if not self.weight > 0:
            raise ValueError(f"source {self.name!r}: field `weight` must be > 0, got {self.weight}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"source {self.name!r}: field `epochs` must be >= 1 or None, got {self.epochs}")
        if len(self.records) == 0:
            raise ValueError(f"source {self.name!r}: has no records")


def _uniform(*key: object) -> float:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64


class PromptStream(Iterator[Record]):
    """Iterates records from the weighted mixture of `sources` until every source with a
    finite `epochs` is exhausted (forever when any source is unbounded)."""

    def __init__(self, sources: Sequence[StreamSource], *, seed: int, shuffle: bool = True) -> None:
        if not sources:
            raise ValueError("sources: need at least one")
        names = [s.name for s in sources]
        if len(set(names)) != len(names):
            raise ValueError(f"sources: names must be unique, got {names}")
        self.sources = list(sources)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.step = 0
        self._epoch = {s.name: 0 for s in sources}
        self._pos = {s.name: 0 for s in sources}
        self._order_cache: dict[str, tuple[int, list[int]]] = {}

    def _order(self, src: StreamSource, epoch: int) -> list[int]:
        cached = self._order_cache.get(src.name)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        order = list(range(len(src.records)))
        if self.shuffle:
            random.Random(f"{self.seed}|{src.name}|{epoch}").shuffle(order)
        self._order_cache[src.name] = (epoch, order)
        return order

    def _active(self) -> list[StreamSource]:
        return [s for s in self.sources if s.epochs is None or self._epoch[s.name] < s.epochs]

    def __iter__(self) -> PromptStream:
        return self

    def __next__(self) -> Record:
        active = self._active()
        if not active:
            raise StopIteration
        total = sum(s.weight for s in active)
        u = _uniform(self.seed, "mix", self.step) * total
        src = active[-1]
        for s in active:
            if u < s.weight:
                src = s
                break
            u -= s.weight
        epoch, pos = self._epoch[src.name], self._pos[src.name]
        record = src.records[self._order(src, epoch)[pos]]
        pos += 1
        if pos == len(src.records):
            epoch, pos = epoch + 1, 0
        self._epoch[src.name], self._pos[src.name] = epoch, pos
        self.step += 1
        return record

    def take(self, n: int) -> list[Record]:
        """Up to `n` next records (fewer only when the stream ends)."""
        out = []
        for _ in range(n):
            try:
                out.append(next(self))
            except StopIteration:
                break
        return out

    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state: step and each source's (epoch, position, size)."""
        return {
            "version": _STATE_VERSION,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "step": self.step,
            "sources": {
                s.name: {"epoch": self._epoch[s.name], "pos": self._pos[s.name], "size": len(s.records)}
                for s in self.sources
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a state from `state_dict()`; the sources must be the same (names, sizes)."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"stream state: field `version` is {state.get('version')!r}, expected {_STATE_VERSION}"
            )
        for key, mine in (("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != mine:
                raise ValueError(
                    f"stream state: field `{key}` is {state.get(key)!r}, this stream has {mine!r}"
                )
        saved = state.get("sources", {})
        if set(saved) != set(self._epoch):
            raise ValueError(
                f"stream state: field `sources` names {sorted(saved)}, this stream has {sorted(self._epoch)}"
            )
        sizes = {s.name: len(s.records) for s in self.sources}
        for name, st in saved.items():
            if st["size"] != sizes[name]:
                raise ValueError(
                    f"stream state: field `sources.{name}.size` is {st['size']}, the source now has {sizes[name]} records"
                )
            if not 0 <= st["pos"] < sizes[name] or st["epoch"] < 0:
                raise ValueError(f"stream state: field `sources.{name}` has an invalid cursor {st}")
        self.step = int(state["step"])
        for name, st in saved.items():
            self._epoch[name], self._pos[name] = int(st["epoch"]), int(st["pos"])
