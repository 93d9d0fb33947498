"""The run's address book: where each server of a launched run listens now.

`rlax launch` (either launcher) writes `<run>/addresses.json` before it starts anything
and names it in the resolved config (`addresses.book`). A server that the Ray launcher has
to restart on another node (its node was lost) gets a new address there; the launcher
rewrites the book, and every client of that server reads the new address the next time it
(re)connects, instead of being restarted: the trainer's and the workers' parameter-server
clients, the trainer's controller client, the controller's worker links and its verifier
client. Locally the addresses never change; the clients read the same book all the same.

    {"paramserver": "tcp://10.0.0.2:40001", "controller": "tcp://...", "worker0": "...", ...}

A config without a book (a component run by hand) keeps its configured addresses.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from rlax_protocol.atomic_files import atomic_write_bytes

if TYPE_CHECKING:
    from rlax_core.config import RunConfig

__all__ = ["ADDRESS_BOOK", "AddressBook", "resolver", "server_addresses", "write_address_book"]

ADDRESS_BOOK = "addresses.json"


def server_addresses(config: RunConfig) -> dict[str, str]:
    """Process name -> its address in `config`, for every process others connect to (a
    multi-host trainer's process 0 hosts the gang's `jax.distributed` coordinator)."""
    workers = list(config.workers.addresses) or ["auto"] * config.workers.count
    servers = {"paramserver": config.paramserver.address, "controller": config.controller.address}
    servers |= {f"worker{i}": a for i, a in enumerate(workers)}
    if config.verifier.mode == "service":
        servers["verifier"] = config.verifier.address
    if config.trainer.hosts > 1:
        servers["trainer0"] = config.trainer.coordinator
    return servers


def write_address_book(path: pathlib.Path, addresses: Mapping[str, str]) -> None:
    """Replace the book at `path` (whole or not at all: readers never see half of it)."""
    atomic_write_bytes(path, json.dumps(dict(addresses), indent=1, sort_keys=True).encode())


class AddressBook:
    """Reads the book at `path`, whole, at every look-up: it is small, read only before a
    reconnect (the controller: once a heartbeat), and on shared storage such as NFS only an
    open() is sure to see another host's latest rename (a stat may be served from cache)."""

    def __init__(self, path: str | pathlib.Path) -> None:
        self.path = pathlib.Path(path)

    def entries(self) -> dict[str, str]:
        """Every process's address now (empty while the book does not exist). A book that is
        not a JSON object of strings raises `ValueError` naming the file."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            entries = json.loads(data)
        except ValueError as error:
            raise ValueError(f"address book {self.path}: not JSON ({error})") from None
        if not isinstance(entries, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in entries.items()
        ):
            raise ValueError(f"address book {self.path}: must map process names to addresses")
        return entries

    def lookup(self, name: str, default: str) -> str:
        """`name`'s address now; `default` while the book does not exist or does not name it."""
        return self.entries().get(name, default)


def resolver(book: str | pathlib.Path, name: str, default: str) -> Callable[[], str] | None:
    """What a client calls before each (re)connect to learn `name`'s address; None (the
    configured address for good) when the config names no book."""
    if not book:
        return None
    reader = AddressBook(book)
    return lambda: reader.lookup(name, default)
