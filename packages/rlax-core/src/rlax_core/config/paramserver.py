"""`paramserver:` how many versions the parameter server keeps, and where."""

from __future__ import annotations

from typing import Literal

from rlax_core.config.base import AUTO, Section, check, check_address


class ParamServerSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`keep`: newest versions held (pinned pulls of older ones need them); `state_dir`: where
    they are persisted (default `<output_dir>/paramserver`); `fsync`: flush each persisted
    version to the disk so it survives a machine crash (false: it survives a SIGKILL of
    any process, which exact resumption needs, and a step saves ~20 ms on a laptop disk).
    `storage: memory`: while the parameter server runs, its versions live in a folder in
    memory (`paramserver_dirs`: a folder on /dev/shm) and rest in `state_dir` only while it is
    stopped (copied there when it stops, back when it starts). A version in memory survives
    a SIGKILL of any process as one in the page cache does, without the disk's cost per
    push: SmolLM2's 540 MB took 1.3-1.7 s of the trainer's step on this machine's ext4
    against 0.35 s. Not across a machine crash (`fsync` does not apply while running);
    where there is no /dev/shm, `disk`."""

    address: str = AUTO
    keep: int = 4
    state_dir: str = ""
    fsync: bool = True
    storage: Literal["disk", "memory"] = "disk"

    def __post_init__(self) -> None:
        check_address("address", self.address)
        check(self.keep >= 1, "keep", self.keep, "must be >= 1")
