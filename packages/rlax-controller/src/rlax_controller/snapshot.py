"""The run snapshot: everything the controller needs to continue on the same trajectory.

One snapshot is written per weight boundary, named by the trainer step (= weight
version) it belongs to: `snapshots/step-000012.json`. The snapshot of step s+1 is written
*before* the batch of step s goes to the trainer, so whichever step the trainer's newest
checkpoint holds after a crash, the matching snapshot exists (a snapshot never names a
checkpoint the trainer cannot have). Files are JSON with a checksum over their body,
written atomically (temp name, fsync, rename, fsync folder).
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import msgspec
import xxhash

from rlax_protocol.atomic_files import atomic_write_bytes

__all__ = ["SNAPSHOT_FORMAT", "RunSnapshot", "SnapshotError", "SnapshotStore"]

SNAPSHOT_FORMAT = 1
_NAME = re.compile(r"^step-(\d{6,})\.json$")


class SnapshotError(RuntimeError):
    """A snapshot file is missing, corrupt, or from an incompatible format."""


class RunSnapshot(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """State of the run at a weight boundary.

    step: trainer steps completed (the weight version the trainer holds after them).
    version: newest weight version published at this boundary (== step).
    stream_state: the prompt stream's serialised state after every prompt of batches < step.
    rng_state: the controller's own RNG state (numpy bit-generator state dict).
    counters: monotonic counters (prompts drawn, rollouts generated / accepted / discarded, ...).
    checkpoint: name of the trainer checkpoint this snapshot belongs to.
    batch_rollout_ids: ids of the rollouts in the batch that produced this step (empty at step 0).
    stream_index: index of the next prompt the stream will yield.
    batch_record: the training metrics record of that batch (re-logged after a crash if missing).
    """

    step: int
    version: int
    stream_state: dict[str, Any]
    stream_index: int
    rng_state: dict[str, Any]
    counters: dict[str, int] = msgspec.field(default_factory=dict)
    checkpoint: str = ""
    batch_rollout_ids: list[str] = msgspec.field(default_factory=list)
    batch_prompt_indices: list[int] = msgspec.field(default_factory=list)
    eval_history: list[dict[str, Any]] = msgspec.field(default_factory=list)
    batch_record: dict[str, Any] = msgspec.field(default_factory=dict)
    format: int = SNAPSHOT_FORMAT


def checkpoint_name(step: int) -> str:
    return f"step_{step}"


class SnapshotStore:
    """A folder of per-step snapshots; keeps the newest `keep`."""

    def __init__(self, folder: str | pathlib.Path, keep: int = 4) -> None:
        if keep < 2:
            raise ValueError(f"SnapshotStore keep = {keep}: must be >= 2 (the committed and the pending one)")
        self.folder = pathlib.Path(folder)
        self.keep = keep

    def path(self, step: int) -> pathlib.Path:
        return self.folder / f"step-{step:06d}.json"

    def steps(self) -> list[int]:
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.match(p.name)))

    def write(self, snapshot: RunSnapshot) -> pathlib.Path:
        body = msgspec.json.encode(snapshot)
        envelope = {"checksum": xxhash.xxh64_hexdigest(body), "snapshot": json.loads(body)}
        path = atomic_write_bytes(self.path(snapshot.step), json.dumps(envelope, indent=1).encode())
        self._prune(keep_step=snapshot.step)
        return path

    def _prune(self, keep_step: int) -> None:
        steps = self.steps()
        for step in steps[: max(0, len(steps) - self.keep)]:
            if step != keep_step:
                self.path(step).unlink(missing_ok=True)

    def read(self, step: int) -> RunSnapshot:
        path = self.path(step)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(
                f"no snapshot for step {step} in {self.folder} (have steps {self.steps()})"
            ) from None
        return decode_snapshot(data, str(path))

    def latest(self) -> RunSnapshot | None:
        steps = self.steps()
        return self.read(steps[-1]) if steps else None


def decode_snapshot(data: bytes, source: str) -> RunSnapshot:
    """Parse and verify a snapshot file's bytes; any damage raises `SnapshotError` naming `source`."""
    try:
        envelope = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SnapshotError(f"snapshot {source} is corrupt: not valid JSON ({error})") from None
    if not isinstance(envelope, dict) or "checksum" not in envelope or "snapshot" not in envelope:
        raise SnapshotError(f"snapshot {source} is corrupt: missing the checksum/snapshot envelope")
    body = json.dumps(envelope["snapshot"], separators=(",", ":")).encode()
    try:
        snapshot = msgspec.json.decode(body, type=RunSnapshot)
    except msgspec.ValidationError as error:
        raise SnapshotError(f"snapshot {source} is corrupt: {error}") from None
    if snapshot.format != SNAPSHOT_FORMAT:
        raise SnapshotError(
            f"snapshot {source} has format {snapshot.format}, this controller reads {SNAPSHOT_FORMAT}"
        )
    actual = xxhash.xxh64_hexdigest(msgspec.json.encode(snapshot))
    if actual != envelope["checksum"]:
        raise SnapshotError(
            f"snapshot {source} is corrupt: checksum {actual} does not match the recorded {envelope['checksum']}"
        )
    return snapshot
