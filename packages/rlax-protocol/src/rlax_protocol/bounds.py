"""Bounds checked on msgpack bytes before any decoder recurses into them.

msgspec decodes recursively (and so does its skipping of values while it looks for a
union's tag), so a few kilobytes of nested maps exhaust the interpreter's recursion
limit; a container or string may also declare a length of billions in a few bytes.
`check_msgpack_bounds` walks the bytes once, iteratively, with an explicit stack, and
rejects a message before decoding when

* it is larger than `max_bytes`,
* containers nest deeper than `max_depth` (the outermost message is depth 1),
* a container declares more items, or a string/binary/extension more bytes, than the
  rest of the message could hold (every item needs at least one byte),
* or it holds the one byte msgpack never uses (``0xc1``) or ends early.

It never builds objects, so its cost is one pass over the item headers; runs of
fixed-size scalars (token ids, log-probabilities) are stepped over in a tight loop.
"""

from __future__ import annotations

from typing import Any

from rlax_protocol.errors import MalformedMessageError

MAX_MESSAGE_DEPTH = 32
"""Deepest container nesting accepted. RLAX's own messages nest at most 5 deep
(message -> manifest -> tensors -> header -> shape); the rest is room for metadata."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest msgpack message part accepted (tensor bytes travel as raw frames, not in here)."""

# Per lead byte: the size of a scalar whose size the lead byte fixes (0 when it does not).
_FIXED_SIZE = [0] * 256
for _b in range(0x00, 0x80):  # positive fixint
    _FIXED_SIZE[_b] = 1
for _b in range(0xE0, 0x100):  # negative fixint
    _FIXED_SIZE[_b] = 1
for _b in range(0xA0, 0xC0):  # fixstr: the length is in the lead byte
    _FIXED_SIZE[_b] = 1 + (_b & 0x1F)
for _b, _size in {
    0xC0: 1,  # nil
    0xC2: 1,  # false
    0xC3: 1,  # true
    0xCA: 5,  # float32
    0xCB: 9,  # float64
    0xCC: 2,  # uint8
    0xCD: 3,
    0xCE: 5,
    0xCF: 9,  # uint64
    0xD0: 2,  # int8
    0xD1: 3,
    0xD2: 5,
    0xD3: 9,  # int64
    0xD4: 3,  # fixext 1: lead, type, 1 byte
    0xD5: 4,
    0xD6: 6,
    0xD7: 10,
    0xD8: 18,  # fixext 16
}.items():
    _FIXED_SIZE[_b] = _size

# Lead bytes followed by a big-endian length of the payload: (length bytes, extra header bytes).
_SIZED_PAYLOAD = {
    0xC4: (1, 0),  # bin 8/16/32
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xC7: (1, 1),  # ext 8/16/32: the length is followed by a type byte
    0xC8: (2, 1),
    0xC9: (4, 1),
    0xD9: (1, 0),  # str 8/16/32
    0xDA: (2, 0),
    0xDB: (4, 0),
}

# Lead bytes of containers with a big-endian item count: (count bytes, items per count).
_SIZED_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def check_msgpack_bounds(
    data: Any, *, max_depth: int = MAX_MESSAGE_DEPTH, max_bytes: int = MAX_MESSAGE_BYTES
) -> None:
    """Raise `MalformedMessageError` unless `data` (msgpack bytes) is within the bounds above.

    `data` is anything with the buffer protocol (bytes, memoryview, a frame's buffer).
    Never recurses, whatever the input.
    """
    try:
        view = memoryview(data).cast("B")
    except (TypeError, ValueError) as err:  # not bytes at all, or not contiguous
        raise MalformedMessageError(f"a message must be one contiguous byte buffer: {err}") from None
    end = view.nbytes
    if end > max_bytes:
        raise MalformedMessageError(f"message of {end} bytes exceeds the limit of {max_bytes}")
    fixed = _FIXED_SIZE
    pos = 0
    # Items still expected by each open container (the outermost entry: the one message).
    pending = [1]
    while pending:
        left = pending[-1]
        if left == 0:
            pending.pop()
            continue
        # Step over a run of fixed-size scalars without touching the stack.
        while left and pos < end:
            size = fixed[view[pos]]
            if not size:
                break
            pos += size
            left -= 1
        pending[-1] = left
        if pos > end:
            raise MalformedMessageError(f"message ends inside an item ({end} bytes)")
        if left == 0:
            continue
        if pos >= end:
            raise MalformedMessageError(f"message ends with {left} item(s) still expected ({end} bytes)")
        pending[-1] = left - 1
        lead = view[pos]
        if 0x80 <= lead <= 0x9F:  # fixmap / fixarray: the count is in the lead byte
            count = (lead & 0x0F) * 2 if lead < 0x90 else lead & 0x0F
            pos += 1
        elif lead in _SIZED_CONTAINER:
            width, per_count = _SIZED_CONTAINER[lead]
            count = int.from_bytes(view[pos + 1 : pos + 1 + width], "big") * per_count
            pos += 1 + width
        elif lead in _SIZED_PAYLOAD:
            width, extra = _SIZED_PAYLOAD[lead]
            length = int.from_bytes(view[pos + 1 : pos + 1 + width], "big")
            pos += 1 + width + extra
            if pos + length > end:
                raise MalformedMessageError(
                    f"an item at byte {pos - 1 - width - extra} declares {length} bytes, "
                    f"only {max(0, end - pos)} follow"
                )
            pos += length
            continue
        else:
            raise MalformedMessageError(f"byte {pos}: 0x{lead:02x} is not a msgpack type")
        if count > end - pos:
            raise MalformedMessageError(
                f"a container at byte {pos} declares {count} items, only {end - pos} bytes follow"
            )
        if len(pending) > max_depth:  # the new container's depth is len(pending)
            raise MalformedMessageError(f"containers nest deeper than {max_depth} levels")
        pending.append(count)
