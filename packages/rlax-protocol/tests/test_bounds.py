"""Depth and size bounds checked before msgspec recurses; hostile bytes never escape `decode`."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rlax_protocol as rp
from rlax_protocol import MalformedMessageError
from rlax_protocol.bounds import MAX_MESSAGE_DEPTH, check_msgpack_bounds
from rlax_protocol.fuzzing import deep_nesting, hostile_requests

REPORTED = b"\x81\xa1a" * 1000 + b"\xc0"  # the 3,001 bytes of the issue


def nesting_depth(value: Any) -> int:
    """Container depth of a Python value: a scalar 0, ``[]`` 1, ``[[1]]`` 2 (the reference)."""
    if isinstance(value, dict):
        return 1 + max((max(nesting_depth(k), nesting_depth(v)) for k, v in value.items()), default=0)
    if isinstance(value, list):
        return 1 + max((nesting_depth(v) for v in value), default=0)
    return 0


scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=40)
trees = st.recursive(
    scalars | st.binary(max_size=300),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=60,
)


def test_reported_message_is_malformed_not_recursion_error() -> None:
    with pytest.raises(MalformedMessageError, match="nest deeper"):
        rp.decode(REPORTED)


@pytest.mark.parametrize("header", [b"\x91", b"\x81\xa1a", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"])
def test_depth_bound_is_exact(header: bytes) -> None:
    check_msgpack_bounds(deep_nesting(MAX_MESSAGE_DEPTH, header=header))
    with pytest.raises(MalformedMessageError, match="nest deeper"):
        check_msgpack_bounds(deep_nesting(MAX_MESSAGE_DEPTH + 1, header=header))


@settings(max_examples=300, deadline=None)
@given(tree=trees, max_depth=st.integers(1, 6))
def test_scan_accepts_exactly_the_trees_within_the_bound(tree: Any, max_depth: int) -> None:
    data = msgspec.msgpack.encode(tree)
    if nesting_depth(tree) <= max_depth:
        check_msgpack_bounds(data, max_depth=max_depth)
    else:
        with pytest.raises(MalformedMessageError, match="nest deeper"):
            check_msgpack_bounds(data, max_depth=max_depth)


@settings(max_examples=200, deadline=None)
@given(tree=trees, cut=st.integers(min_value=1))
def test_truncated_encodings_are_rejected_by_the_scan(tree: Any, cut: int) -> None:
    data = msgspec.msgpack.encode(tree)
    short = data[: len(data) - 1 - cut % len(data)]
    with pytest.raises(MalformedMessageError):
        check_msgpack_bounds(short)


@pytest.mark.parametrize(
    "data",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 G items in 5 bytes
        b"\xdf\xff\xff\xff\xff\xc0\xc0",
        b"\xdb\xff\xff\xff\xffabc",
        b"\xc6\x7f\xff\xff\xff",
        b"\xc9\xff\xff\xff\xff\x01",
        b"\x92\xdc\xff\xff\xc0",
    ],
)
def test_declared_lengths_beyond_the_message_are_rejected(data: bytes) -> None:
    with pytest.raises(MalformedMessageError, match="declares"):
        check_msgpack_bounds(data)


def test_size_bound() -> None:
    data = msgspec.msgpack.encode("x" * 1000)
    check_msgpack_bounds(data, max_bytes=len(data))
    with pytest.raises(MalformedMessageError, match="exceeds the limit"):
        rp.decode(data, max_bytes=len(data) - 1)


def test_deep_metadata_inside_a_valid_push_is_malformed() -> None:
    # `metadata` is dict[str, Any]: typed decoding would recurse into it.
    manifest = rp.TensorManifest(protocol_version=rp.PROTOCOL_VERSION, chunk_bytes=4, tensors=())
    good = rp.encode(rp.PushBegin(version=1, manifest=manifest, metadata={"k": "PLACEHOLDER"}))
    bad = good.replace(msgspec.msgpack.encode("PLACEHOLDER"), REPORTED)
    with pytest.raises(MalformedMessageError, match="nest deeper"):
        rp.decode(bad)
    assert rp.decode(good) == rp.PushBegin(version=1, manifest=manifest, metadata={"k": "PLACEHOLDER"})


def test_ten_thousand_hostile_requests_never_raise_anything_else() -> None:
    valid = [
        rp.encode(rp.PullBegin()),
        rp.encode(rp.VerifyRequest(request_id="a", verifier="m", completion="c")),
    ]
    kinds = 0
    for parts in hostile_requests(10_000, seed=1, valid=valid):
        request = rp.parse_request(
            [rp.transport.zmq.Frame(b"id"), *(rp.transport.zmq.Frame(p) for p in parts)]
        )
        assert (request.message is None) == (request.error is not None)
        kinds += request.error is None
    assert 500 < kinds < 5000  # valid requests are mixed in, most are refused


def test_non_contiguous_or_non_byte_input_is_malformed() -> None:
    data = bytearray(rp.encode(rp.LatestQuery()) * 2)
    with pytest.raises(MalformedMessageError, match="contiguous"):
        rp.decode(memoryview(data)[::2])
    with pytest.raises(MalformedMessageError, match="contiguous"):
        rp.decode("not bytes")  # type: ignore[arg-type]
