"""The base of every RLAX wire message and the check its fields share (docs/design.md, "Messages: the wire protocol").

Kept apart from `rlax_protocol.messages` so that each family of messages (tensors,
parameter server, generation, verification) can live in its own module and
`messages` can gather them all into one decoder without importing itself.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
"""Bumped whenever a message changes incompatibly; exchanged in `Hello`/`Welcome` and every manifest."""


class Message(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Base of every wire message; the tag is the class name."""


def reject_field(struct: str, field: str, value: object, why: str) -> None:
    """Raise the `ValueError` a message's `__post_init__` reports an invalid field with."""
    raise ValueError(f"{struct}.{field}={value!r}: {why}")
