"""Tensor-tree codec: bit-exact round trips, checksums, and bad frame lists."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rlax_protocol import (
    PROTOCOL_VERSION,
    ChecksumError,
    MalformedMessageError,
    ProtocolError,
    TensorManifest,
    TreeAssembler,
    VersionMismatchError,
    decode_flat,
    decode_tree,
    encode_tree,
    flatten_tree,
    frame_layout,
    frames_by_tensor,
    unflatten_tree,
    with_checksums,
)

# Each dtype is drawn as raw bits of the same width so NaN payloads, -0.0 and
# subnormals are all covered and compared bit for bit.
BIT_TYPES = {
    "float32": np.uint32,
    "float16": np.uint16,
    "bfloat16": np.uint16,
    "float64": np.uint64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
}
DTYPES = {name: (ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)) for name in BIT_TYPES}

shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)


@st.composite
def tensors(draw: st.DrawFn) -> np.ndarray:
    name = draw(st.sampled_from([*BIT_TYPES, "bool"]))
    shape = draw(shapes)
    if name == "bool":
        return draw(hnp.arrays(np.bool_, shape))
    bits = draw(hnp.arrays(BIT_TYPES[name], shape))
    return bits.view(DTYPES[name])


keys = st.text(alphabet="abcdefghij0123456789_.", min_size=1, max_size=6)
trees = st.recursive(
    st.dictionaries(keys, tensors(), min_size=1, max_size=4),
    lambda children: st.dictionaries(keys, children, min_size=1, max_size=3),
    max_leaves=12,
)


def assert_bit_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@settings(max_examples=150, deadline=None)
@given(tree=trees, chunk_bytes=st.sampled_from([1, 3, 7, 64, 1 << 20]))
def test_round_trip_is_bit_exact(tree: dict, chunk_bytes: int) -> None:
    encoded = encode_tree(tree, chunk_bytes=chunk_bytes)
    # Frames travel as independent byte strings, as after a socket.
    out = decode_flat(encoded.manifest, [bytes(f) for f in encoded.frames])
    flat = flatten_tree(tree)
    assert list(out) == list(flat)
    for name in flat:
        assert_bit_equal(out[name], flat[name])
        assert not out[name].flags.writeable


@pytest.mark.parametrize("name", [*DTYPES, "bool"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (5,), (2, 3, 4)])
def test_every_dtype_and_shape(name: str, shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    if name == "bool":
        array = rng.random(shape) > 0.5
    else:
        width = np.dtype(BIT_TYPES[name]).itemsize
        array = np.frombuffer(rng.bytes(int(np.prod(shape)) * width), dtype=DTYPES[name]).reshape(shape)
    tree = {"layers": {"0": {"attn": {"q": array}}}}
    encoded = encode_tree(tree, chunk_bytes=5)
    assert encoded.manifest.tensors[0].name == "layers/0/attn/q"
    out = decode_tree(encoded.manifest, [bytes(f) for f in encoded.frames])
    assert_bit_equal(out["layers"]["0"]["attn"]["q"], array)


def test_encode_is_zero_copy_and_single_frame_decode_shares_buffer() -> None:
    array = np.arange(1000, dtype=np.float32)
    encoded = encode_tree({"w": array})
    assert len(encoded.frames) == 1
    assert np.shares_memory(np.frombuffer(encoded.frames[0], dtype=np.uint8), array)
    received = bytearray(encoded.frames[0])
    out = decode_flat(encoded.manifest, [received])
    assert np.shares_memory(out["w"], np.frombuffer(received, dtype=np.uint8))


def test_non_contiguous_and_big_endian_inputs() -> None:
    base = np.arange(24, dtype=np.int32).reshape(4, 6)
    tree = {"t": base.T, "be": np.arange(5, dtype=">i4")}
    encoded = encode_tree(tree, chunk_bytes=16)
    out = decode_flat(encoded.manifest, encoded.frames)
    np.testing.assert_array_equal(out["t"], base.T)
    assert out["be"].dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out["be"], np.arange(5))


def test_chunk_layout() -> None:
    tree = {"a": np.zeros(10, np.uint8), "b": np.zeros(0, np.uint8), "c": np.zeros(4, np.uint8)}
    encoded = encode_tree(tree, chunk_bytes=4)
    assert encoded.manifest.frames_per_tensor() == [3, 1, 1]
    assert [len(f) for f in encoded.frames] == [4, 4, 2, 0, 4]
    slots = frame_layout(encoded.manifest)
    assert [(s.tensor, s.offset, s.nbytes) for s in slots] == [
        (0, 0, 4),
        (0, 4, 4),
        (0, 8, 2),
        (1, 0, 0),
        (2, 0, 4),
    ]


def _encoded(chunk_bytes: int = 8):
    tree = {"emb": np.arange(20, dtype=np.float32), "norm": np.ones(3, dtype=ml_dtypes.bfloat16)}
    encoded = encode_tree(tree, chunk_bytes=chunk_bytes)
    return encoded.manifest, [bytes(f) for f in encoded.frames]


@pytest.mark.parametrize("position", [0, 5, 9, 10])
def test_flipped_byte_names_the_tensor(position: int) -> None:
    manifest, frames = _encoded()
    frame = bytearray(frames[position])
    frame[len(frame) // 2] ^= 0x40
    frames[position] = bytes(frame)
    expected = "emb" if position < 10 else "norm"
    with pytest.raises(ChecksumError, match=f"'{expected}'") as info:
        decode_flat(manifest, frames)
    assert info.value.tensor == expected


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_damaged_frame_lists_raise_protocol_errors(data: st.DataObject) -> None:
    manifest, frames = _encoded(chunk_bytes=data.draw(st.sampled_from([4, 8, 12])))
    kind = data.draw(st.sampled_from(["truncate", "extend", "reorder", "resize", "random"]))
    if kind == "truncate":
        frames = frames[: data.draw(st.integers(0, len(frames) - 1))]
    elif kind == "extend":
        frames = frames + [data.draw(st.binary(max_size=16))]
    elif kind == "reorder":
        permuted = data.draw(st.permutations(frames))
        if permuted == frames:
            return
        frames = permuted
    elif kind == "resize":
        i = data.draw(st.integers(0, len(frames) - 1))
        frames[i] = frames[i] + b"x" if data.draw(st.booleans()) or not frames[i] else frames[i][:-1]
    else:
        frames = data.draw(st.lists(st.binary(max_size=24), max_size=len(frames) + 2))
    with pytest.raises((MalformedMessageError, ChecksumError)):
        decode_flat(manifest, frames)


def test_manifest_from_another_version_names_both() -> None:
    manifest, frames = _encoded()
    other = TensorManifest(
        protocol_version=PROTOCOL_VERSION + 1, chunk_bytes=manifest.chunk_bytes, tensors=manifest.tensors
    )
    with pytest.raises(VersionMismatchError) as info:
        decode_flat(other, frames)
    assert f"version {PROTOCOL_VERSION}" in str(info.value) and f"version {PROTOCOL_VERSION + 1}" in str(
        info.value
    )
    assert isinstance(info.value, ProtocolError)


def test_bad_trees_name_the_path() -> None:
    with pytest.raises(TypeError, match="'a/b'"):
        encode_tree({"a": {"b": [1, 2]}})
    with pytest.raises(ValueError, match="complex64"):
        encode_tree({"a": np.zeros(2, np.complex64)})
    with pytest.raises(ValueError, match="'x/y'"):
        encode_tree({"x/y": np.zeros(2)})
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_tree({"a": np.zeros(2)}, chunk_bytes=0)
    with pytest.raises(ValueError, match="prefix"):
        unflatten_tree({"a": np.zeros(1), "a/b": np.zeros(1)})


@settings(max_examples=100, deadline=None)
@given(tree=trees, chunk_bytes=st.sampled_from([1, 5, 64]), data=st.data())
def test_assembler_accepts_messages_in_any_order(tree: dict, chunk_bytes: int, data: st.DataObject) -> None:
    encoded = encode_tree(tree, chunk_bytes=chunk_bytes)
    frames = [bytes(f) for f in encoded.frames]
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(frames)), max_size=6)) + [0, len(frames)]))
    runs = [(a, frames[a:b]) for a, b in zip(cuts, cuts[1:])]
    assembler = TreeAssembler(encoded.manifest)
    for first, part in data.draw(st.permutations(runs)):
        assembler.add(first, part)
    out = assembler.result()
    for name, array in flatten_tree(tree).items():
        assert_bit_equal(out[name], array)


def test_assembler_rejects_duplicates_gaps_and_out_of_range() -> None:
    manifest, frames = _encoded()
    assembler = TreeAssembler(manifest)
    assembler.add(0, frames[:2])
    with pytest.raises(MalformedMessageError, match="received twice"):
        assembler.add(1, frames[1:2])
    with pytest.raises(MalformedMessageError, match="outside"):
        assembler.add(len(frames), frames[:1])
    with pytest.raises(MalformedMessageError, match="never arrived"):
        assembler.result()


def test_encoding_a_tree_keeps_no_reference_to_it_once_dropped() -> None:
    """Without the cyclic garbage collector, a pushed tree's arrays are freed as soon as the
    caller and the encoding drop them (a trainer's next update reuses that memory)."""
    import gc
    import weakref

    leaf = np.zeros((256, 256), np.float32)
    alive = weakref.ref(leaf)
    gc.disable()
    try:
        encoded = encode_tree({"layers": {"w": leaf}, "b": np.ones(3, np.float32)})
        assert len(encoded.frames) >= 1
        del leaf, encoded
        assert alive() is None
    finally:
        gc.enable()


def test_checksums_filled_in_later_are_those_of_a_single_encoding() -> None:
    """`encode_tree(checksums=False)` then `with_checksums` (a sender that hashes as it
    sends) gives the manifest of one `encode_tree`, multi-frame tensors included."""
    tree = {"a": np.arange(1000, dtype=np.float32), "b": {"c": np.ones((3, 5), np.int8)}, "e": np.zeros(0)}
    lazy = encode_tree(tree, chunk_bytes=1000, checksums=False)
    assert all(t.checksum == 0 for t in lazy.manifest.tensors)
    eager = encode_tree(tree, chunk_bytes=1000)
    assert with_checksums(lazy).manifest == eager.manifest
    assert [len(f) for f in frames_by_tensor(lazy.manifest, lazy.frames)] == [4, 1, 1]
    with pytest.raises(ValueError, match="5 frames for a manifest of 6"):
        frames_by_tensor(lazy.manifest, lazy.frames[:5])
