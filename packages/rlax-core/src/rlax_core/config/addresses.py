"""`addresses:` where `auto` addresses bind, and the run's address book."""

from __future__ import annotations

from rlax_core.config.base import Section, check


class AddressesSection(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where `auto` addresses bind in a local launch (a multi-host run writes endpoints instead).

    `book`: the run's address book (`rlax_core.addresses`), set by `rlax launch` in the
    config it writes: a client reads a server's address there before each reconnect, so a
    server the launcher moved to another node is found without restarting its clients.
    Empty (a component run by hand): the addresses above are used for good."""

    host: str = "127.0.0.1"
    book: str = ""

    def __post_init__(self) -> None:
        check(bool(self.host) and " " not in self.host, "host", self.host, "must be a host name or IP")
