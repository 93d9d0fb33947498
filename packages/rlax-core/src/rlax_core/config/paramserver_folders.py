"""Where the parameter server keeps a run's versions: on disk, or in memory while it runs."""

from __future__ import annotations

import hashlib
import logging
import pathlib
import shutil

from rlax_core.config.run_config import RunConfig

MEMORY_ROOT = pathlib.Path("/dev/shm")


# Less free memory there than this and `storage: memory` means disk: a container's /dev/shm
# is often 64 MB, and a version that does not fit would fail every push.
MEMORY_MIN_FREE_BYTES = 4 << 30


def _rest_state_dir(config: RunConfig) -> pathlib.Path:
    return pathlib.Path(config.paramserver.state_dir or config.output_dir / "paramserver")


def _memory_state_dir(rest: pathlib.Path) -> pathlib.Path:
    digest = hashlib.sha256(str(rest.resolve()).encode()).hexdigest()[:16]
    return MEMORY_ROOT / f"rlax-paramserver-{digest}"


def paramserver_dirs(config: RunConfig) -> tuple[pathlib.Path, pathlib.Path | None]:
    """(where the parameter server keeps the versions it serves, where they rest while it is
    stopped or None). `storage: disk`: (`state_dir`, None). `storage: memory`: a folder on
    /dev/shm named after `state_dir` (a relaunch of the same run finds it again), and
    `state_dir`; disk where /dev/shm is missing or has less than 4 GiB free (and the run's
    folder is not there already)."""
    rest = _rest_state_dir(config)
    if config.paramserver.storage == "memory" and MEMORY_ROOT.is_dir():
        live = _memory_state_dir(rest)
        if live.is_dir() or shutil.disk_usage(MEMORY_ROOT).free >= MEMORY_MIN_FREE_BYTES:
            return live, rest
        logging.getLogger("rlax.config").warning(
            "paramserver.storage: memory: %s has less than %d GiB free; versions stay on disk in %s",
            MEMORY_ROOT,
            MEMORY_MIN_FREE_BYTES >> 30,
            rest,
        )
    return rest, None


def published_state_dir(config: RunConfig) -> pathlib.Path:
    """Where a reader (`rlax eval`) finds a run's newest published version: the parameter
    server's folder in memory while it has state files (the run is live), else `state_dir`."""
    rest = _rest_state_dir(config)
    if config.paramserver.storage == "memory":
        live = _memory_state_dir(rest)
        if any(live.glob("weights-v*.rlaxw")):
            return live
    return rest
