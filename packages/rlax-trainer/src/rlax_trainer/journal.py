"""The trainer's batch journal: every batch it trains, on disk before the update runs.

A checkpoint of the train state is 3x the model (float32 weights plus Adam's two moments:
1.6 GB for SmolLM2-135M), too much to write at every step on a laptop. With
`trainer.checkpoint_every: N` the trainer checkpoints every N steps and journals each
batch instead (kilobytes to megabytes); a restarted trainer restores the newest checkpoint
and replays the journaled batches after it through the same deterministic update, so it
reaches the exact weights it had published before it died and the run goes on along the
same trajectory. Entries older than the oldest checkpoint kept are deleted.

One file per step, `step-<8 digits>.batch`: a magic tag, the SHA-256 of the payload, the
payload (the controller's `TrainBatch` as msgpack; nothing is pickled). Each is written to
a temporary name, fsynced and renamed, so an entry is either whole or absent; one whose
checksum fails (disk damage) is reported by `JournalDamagedError` naming the file.
"""

from __future__ import annotations

import hashlib
import pathlib
import re

from rlax_protocol.atomic_files import atomic_write_bytes

__all__ = ["BatchJournal", "JournalDamagedError"]

_MAGIC = b"RLAXJNL1"
_DIGEST = 32
_NAME = re.compile(r"^step-(\d{8,})\.batch$")


class JournalDamagedError(RuntimeError):
    """A journal entry whose bytes fail their checksum or lack the header."""

    def __init__(self, path: pathlib.Path, reason: str) -> None:
        super().__init__(f"journal entry {path} is damaged: {reason}")
        self.path = path


class BatchJournal:
    """Payloads by trainer step under `directory` (created on the first write)."""

    def __init__(self, directory: str | pathlib.Path) -> None:
        self.directory = pathlib.Path(directory)

    def _path(self, step: int) -> pathlib.Path:
        return self.directory / f"step-{step:08d}.batch"

    def write(self, step: int, payload: bytes) -> None:
        """Store the payload of `step` durably (replacing an entry of the same step)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        atomic_write_bytes(self._path(step), _MAGIC + hashlib.sha256(payload).digest() + payload)

    def read(self, step: int) -> bytes | None:
        """The payload of `step`, None when there is no entry; JournalDamagedError if damaged."""
        path = self._path(step)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        head = len(_MAGIC) + _DIGEST
        if len(data) < head or not data.startswith(_MAGIC):
            raise JournalDamagedError(path, f"no {_MAGIC.decode()} header ({len(data)} bytes)")
        payload = data[head:]
        if hashlib.sha256(payload).digest() != data[len(_MAGIC) : head]:
            raise JournalDamagedError(path, "SHA-256 of the payload differs from the stored one")
        return payload

    def steps(self) -> list[int]:
        """Steps with an entry, ascending."""
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def prune(self, before: int) -> None:
        """Delete the entries of steps < `before` (a checkpoint at `before` or later covers them)."""
        for step in self.steps():
            if step < before:
                self._path(step).unlink(missing_ok=True)

    def prune_from(self, first: int) -> None:
        """Delete the entries of steps >= `first` (a damaged entry and whatever follows it)."""
        for step in self.steps():
            if step >= first:
                self._path(step).unlink(missing_ok=True)

    def clear(self) -> None:
        """Delete every entry (a run that starts from scratch has none to replay)."""
        self.prune(before=1 << 62)
