"""Hostile requests for the fuzz tests of every RLAX server (shared so that all face the same).

`hostile_requests(count, seed=..., valid=[...])` yields `count` multipart requests as a
DEALER client sends them (``[request_id, message, *frames]``): deep nesting (bare, and
spliced into every field of each valid message, before and after the tag), huge
declared lengths, truncations, byte flips, random bytes, wrong part counts, valid
messages of the wrong type, and the valid messages themselves, interleaved. Pass the
encoded requests a server normally serves as `valid`, so that mutations reach its
handlers and not only the decoder.

`blast(address, requests, ...)` sends them from one DEALER (saying `Hello` first, so
that they get past the handshake), keeps reading replies so that no queue fills, and
returns how many replies came back. A test then checks that a correct request from a
fresh client is still answered.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import msgspec
import zmq

from rlax_protocol.messages import PROTOCOL_VERSION, Hello, Welcome, encode

Parts = list[bytes]

_NESTING_HEADERS = (b"\x91", b"\x81\xa1a", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k")
_HUGE_LENGTHS = (
    b"\xdd\xff\xff\xff\xff",  # array of 4 G items
    b"\xdf\xff\xff\xff\xff",  # map of 4 G pairs
    b"\xdb\xff\xff\xff\xff",  # str of 4 GB
    b"\xc6\xff\xff\xff\xff",  # bin of 4 GB
    b"\xc9\xff\xff\xff\xff\x01",  # ext of 4 GB
    b"\xdc\xff\xff",
    b"\xde\xff\xff",
    b"\xda\xff\xff",
)
_PLACEHOLDER = "\x00rlax-fuzz-placeholder\x00"


def request_id_part(request_id: int) -> bytes:
    """The 8-byte little-endian request id frame a client puts before the message."""
    return request_id.to_bytes(8, "little")


def deep_nesting(depth: int, *, header: bytes = b"\x81\xa1a") -> bytes:
    """`depth` nested one-item containers ending in nil (the default: ``{"a": {"a": ...}}``)."""
    return header * depth + b"\xc0"


def _splice_everywhere(message: bytes, payload: bytes) -> list[bytes]:
    """Copies of a msgpack map message with one field's value (or a new first/last
    field) replaced by `payload` raw msgpack bytes; [] if `message` is not a map."""
    try:
        fields = msgspec.msgpack.decode(message)
    except msgspec.DecodeError:
        return []
    if not isinstance(fields, dict):
        return []
    marker = msgspec.msgpack.encode(_PLACEHOLDER)
    variants: list[bytes] = []
    for key in list(fields) + ["zz-extra"]:
        changed = dict(fields)
        changed[key] = _PLACEHOLDER
        variants.append(msgspec.msgpack.encode(changed).replace(marker, payload))
    # A value to skip before the tag: decoders that look for the tag skip it recursively.
    first = {"aa-first": _PLACEHOLDER, **fields}
    variants.append(msgspec.msgpack.encode(first).replace(marker, payload))
    return variants


def _mutate(rng: random.Random, message: bytes) -> bytes:
    choice = rng.randrange(5)
    if choice == 0 and message:
        return message[: rng.randrange(len(message))]  # truncated
    if choice == 1 and message:
        data = bytearray(message)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)
    if choice == 2 and message:
        at = rng.randrange(len(message))
        return message[:at] + rng.choice(_HUGE_LENGTHS) + message[at:]
    if choice == 3:
        return message + rng.randbytes(rng.randint(1, 16))  # trailing garbage
    return rng.randbytes(rng.randint(0, 64))


def hostile_requests(count: int, *, seed: int = 0, valid: Sequence[bytes] = ()) -> Iterator[Parts]:
    """`count` requests (``[request_id, message, *frames]``), hostile and valid mixed.

    Deterministic for a given `seed`. `valid` are encoded messages the server accepts;
    about one request in ten is one of them unchanged.
    """
    rng = random.Random(seed)
    bases = [bytes(v) for v in valid] or [encode(Hello(protocol_version=PROTOCOL_VERSION))]
    spliced: list[bytes] = []
    for base in bases:
        for depth in (40, 3000):
            spliced.extend(_splice_everywhere(base, deep_nesting(depth)))
        spliced.extend(_splice_everywhere(base, rng.choice(_HUGE_LENGTHS)))
    wrong_type = [
        encode(Welcome(protocol_version=PROTOCOL_VERSION)),
        encode(Hello(protocol_version=PROTOCOL_VERSION + 1000)),
    ]
    for n in range(count):
        rid = request_id_part(n + 1)
        kind = n % 10
        if kind == 0:
            header = rng.choice(_NESTING_HEADERS)
            yield [rid, deep_nesting(rng.choice((33, 1000, 5000, 100_000)), header=header)]
        elif kind == 1:
            yield [rid, rng.choice(_HUGE_LENGTHS) + rng.randbytes(rng.randint(0, 8))]
        elif kind == 2 and spliced:
            yield [rid, rng.choice(spliced)]
        elif kind == 3:
            yield [rid, _mutate(rng, rng.choice(bases))]
        elif kind == 4:
            # Wrong framing: a bad request id, no message, or extra raw frames.
            yield rng.choice(
                [
                    [rng.randbytes(rng.randint(0, 12)), rng.choice(bases)],
                    [rid],
                    [rid, rng.choice(bases), *(rng.randbytes(rng.randint(0, 32)) for _ in range(3))],
                    [b"", b"", b""],
                ]
            )
        elif kind == 5:
            yield [rid, rng.choice(wrong_type)]
        elif kind == 6:
            yield [rid, rng.choice(bases)]
        elif kind == 7 and spliced:
            yield [rid, rng.choice(spliced)]
        elif kind == 8:
            yield [rid, _mutate(rng, rng.choice(bases))]
        else:
            yield [rid, rng.randbytes(rng.randint(0, 256))]


def blast(
    address: str,
    requests: Iterable[Sequence[bytes]],
    *,
    hello: bool = True,
    window: int = 200,
    settle_s: float = 1.0,
    timeout_s: float = 60.0,
    max_silent_waits: int = 5,
    context: zmq.Context[Any] | None = None,
) -> int:
    """Send every request from one DEALER (after a `Hello` if `hello`), reading replies as
    they come; returns how many replies arrived.

    At most `window` requests are left unanswered before it reads replies (giving up
    after `settle_s` of silence), so that the server's send queue to this client (1000
    messages by default, beyond which ZeroMQ drops replies) never fills; requests still
    unanswered after such a wait are written off (a server may rightly leave a frame it
    cannot attribute unanswered), so each costs that wait once. After the last send it
    reads replies until `settle_s` passes without one.
    Raises `TimeoutError` if the server stops accepting messages for `timeout_s`, or
    answers nothing through `max_silent_waits` such waits in a row: a server whose loop
    died then fails the caller in seconds, not after one wait per remaining request.
    """
    ctx = context or zmq.Context.instance()
    socket: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(address)
    sent = replies = written_off = silent_waits = 0

    def drain(wait_ms: int, *, until_outstanding: int = 0) -> int:
        # Read replies until at most `until_outstanding` remain or none came for `wait_ms`;
        # returns how many arrived.
        nonlocal replies
        before = replies
        while sent - replies - written_off > until_outstanding and socket.poll(wait_ms, zmq.POLLIN):
            socket.recv_multipart()
            replies += 1
        return replies - before

    try:
        if hello:
            socket.send_multipart([request_id_part(0), encode(Hello(protocol_version=PROTOCOL_VERSION))])
            sent += 1
        for parts in requests:
            if not socket.poll(int(timeout_s * 1000), zmq.POLLOUT):
                raise TimeoutError(f"{address} stopped accepting messages for {timeout_s}s")
            socket.send_multipart(list(parts))
            sent += 1
            drain(0)
            if sent - replies - written_off > window:
                if drain(int(settle_s * 1000), until_outstanding=window // 2) == 0:
                    silent_waits += 1
                    if silent_waits >= max_silent_waits:
                        raise TimeoutError(
                            f"{address} answered none of its last {sent - replies} requests "
                            f"through {silent_waits} waits of {settle_s}s: its loop stopped"
                        )
                else:
                    silent_waits = 0
                written_off = max(written_off, sent - replies - window // 2)
        drain(int(settle_s * 1000))
    finally:
        socket.close(0)
    return replies
