"""What the Ray backend's registry (`ray_actors`) tells the launcher, as typed records.

The registry answers with plain data (it runs where rlax-controller may not be installed);
`processes` reads a snapshot's processes into these records, and `ProcessPlan` is what the
launcher hands the registry for each process (as plain data, by `ProcessPlan.wire`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

__all__ = [
    "LOST_EXIT",
    "PYTHON",
    "LifeLog",
    "LostLife",
    "MovedTo",
    "NodeInfo",
    "ProcessPlan",
    "ProcessRecord",
    "processes",
]

LOST_EXIT = -9  # the exit recorded for a life that went down with its node (as if SIGKILLed)
PYTHON = "{python}"  # in a command: the interpreter of the actor that runs it


class NodeInfo(msgspec.Struct, frozen=True):
    """Where a life ran: the Ray node, its IP and host name, the actor's and component's pids."""

    node_id: str = ""
    node_ip: str = ""
    hostname: str = ""
    actor_pid: int = 0
    pid: int = 0


class MovedTo(NodeInfo, frozen=True):
    """A server restarted on another node than its address's: that node; `seq`: when."""

    seq: int = 0


class LostLife(msgspec.Struct, frozen=True):
    """A life that went down with its node (or its actor) without reporting an exit."""

    run: int
    node_id: str


class ProcessRecord(msgspec.Struct, frozen=True):
    """One process in a registry snapshot: how many lives started, every exit with the life
    it ended (`exit_runs`), the exit that ends it for good (`final`), its current life
    (`run`) and node, the node of every life, its lost lives and a pending move."""

    starts: int = 0
    exits: list[int] = []
    exit_runs: list[int] = []
    final: int | None = None
    run: int = 0
    node: NodeInfo = NodeInfo()
    life_nodes: dict[int, str] = {}
    lost: list[LostLife] = []
    moved: MovedTo | None = None

    @property
    def running(self) -> bool:
        """A life runs (not restarting, nor waiting for a move)."""
        return self.starts > len(self.exits)


class LifeLog(msgspec.Struct, frozen=True):
    """Where one life wrote in its log (`end` None: to the end) and the tail its actor read
    at the exit (None: it never reported one)."""

    start: int = 0
    end: int | None = None
    tail: str | None = None


class ProcessPlan(msgspec.Struct, frozen=True):
    """How to (re)start one process: its command line, environment additions, working
    folder and log file, and the IP its address is bound to (restarted on another node, the
    actor asks for a new address)."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    log: str
    bind_ip: str

    def wire(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)  # type: ignore[no-any-return]


def processes(procs: Mapping[str, Any]) -> dict[str, ProcessRecord]:
    """A snapshot's processes (plain data) as records."""
    return {name: msgspec.convert(entry, ProcessRecord) for name, entry in procs.items()}
