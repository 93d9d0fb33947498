"""JSON reports written atomically (`rlax_protocol.atomic_files`: temp file, fsync, rename)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from rlax_protocol.atomic_files import atomic_write_bytes


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write `obj` (anything msgspec can encode) as indented JSON, atomically."""
    return atomic_write_bytes(path, msgspec.json.format(msgspec.json.encode(obj), indent=2) + b"\n")
