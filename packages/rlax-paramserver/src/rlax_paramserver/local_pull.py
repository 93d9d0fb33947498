"""A pull on the parameter server's own host: the granted version read as views of the
server's state file (mapped, no bytes sent) instead of frames over the socket."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

from rlax_paramserver.persist import CorruptStateError, map_state
from rlax_protocol import ProtocolError, PullGranted, TreeAssembler, unflatten_tree

log = logging.getLogger(__name__)


def map_granted_version(lease: PullGranted, *, verify: bool) -> dict[str, Any] | None:
    """The granted version as views of its state file, or None when this host cannot
    use the file (another host, gone since, or not the promised bytes)."""
    path = pathlib.Path(lease.state_file)
    try:
        # Private pages: a write through a view (a donated buffer) never reaches the file.
        state = map_state(path, verify=False, expect=lease.manifest, copy_on_write=True)
        if state.version != lease.version:
            raise CorruptStateError(f"{path}: holds version {state.version}, not {lease.version}")
        assembler = TreeAssembler(lease.manifest, verify=verify)
        for index, data in enumerate(state.tensors):
            assembler.add_tensor(index, data)
        return unflatten_tree(assembler.result())
    except (OSError, ProtocolError) as err:  # ChecksumError and CorruptStateError are ProtocolErrors
        log.info("pulling version %d over the network: cannot map %s: %s", lease.version, path, err)
        return None
