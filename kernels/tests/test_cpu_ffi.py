"""The native CPU kernel's FFI handler, called the way XLA calls it: with hand-built call
frames (so that every check can be hit with a corrupt one) and through JAX."""

import ctypes
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numba
import numpy as np
import pytest
from numba import types

from rlax_kernels.paged_attention import paged_attention_cpu, paged_attention_xla
from rlax_kernels.paged_attention.cpu import compiled_handler
from rlax_kernels.paged_attention.cpu_ffi import FFI_API_VERSION, make_handler
from rlax_kernels.paged_attention.reference import paged_attention_reference

F32, S32 = 11, 4  # XLA_FFI_DataType values, from c_api.h
ERROR = 0x5EED  # what the fake XLA_FFI_Error_Create returns


class FakeXla:
    """An XLA_FFI_Api whose XLA_FFI_Error_Create records (message, code), and call frames
    laid out as c_api.h (0.3) lays them out. Keeps every array it hands out alive."""

    def __init__(self, runtime_version=(0, 3)):
        self.errors = []
        self.keep = []

        @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
        def create_error(address):
            words = (ctypes.c_int64 * 4).from_address(address)
            self.errors.append((ctypes.string_at(words[2]).decode(), words[3] & 0xFFFFFFFF))
            return ERROR

        self.create_error = create_error
        major, minor = runtime_version
        self.api = self.array([8 * 24, 0, 24, 0, major | minor << 32, 0, ctypes.cast(create_error, ctypes.c_void_p).value]
                              + [0] * 17)  # fmt: skip

    def array(self, values, dtype=np.int64):
        a = np.ascontiguousarray(values, dtype)
        self.keep.append(a)
        return a

    def buffer(self, array, dtype_code):
        """An XLA_FFI_Buffer (as its int64 words) over `array`."""
        dims = self.array(array.shape)
        return self.array([48, 0, dtype_code, array.ctypes.data, array.ndim, dims.ctypes.data])

    def frame(self, arg_buffers, result_buffer, *, extension=0, stage=3):
        args = self.array([b.ctypes.data for b in arg_buffers])
        kinds = self.array(np.ones(len(arg_buffers)), np.int32)
        rets = self.array([result_buffer.ctypes.data])
        ret_kinds = self.array([1], np.int32)
        return self.array(
            [176, extension, self.api.ctypes.data, 0, stage,
             40, 0, len(arg_buffers), kinds.ctypes.data, args.ctypes.data,
             40, 0, 1, ret_kinds.ctypes.data, rets.ctypes.data,
             48, 0, 0, 0, 0, 0, 0]
        )  # fmt: skip


def decode_case(layers=2, layer=1):
    """Operands of one decode step, the expected output (reference) and a NaN-filled result."""
    rng = np.random.default_rng(0)
    batch, heads, kv_heads, head_dim, pages, page_size = 2, 4, 2, 8, 6, 4
    q = rng.normal(size=(batch, heads, head_dim)).astype(np.float32)
    k = rng.normal(size=(layers, kv_heads, pages, page_size, head_dim)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    lengths = np.array([5, 9], np.int32)
    tables = np.array([[3, 1, 0], [2, 5, 4]], np.int32)
    new_k = rng.normal(size=(batch, kv_heads, head_dim)).astype(np.float32)
    new_v = rng.normal(size=new_k.shape).astype(np.float32)
    scalars = np.array([layer, 1, 0], np.int32)
    scale = np.array([head_dim**-0.5], np.float32)
    operands = [q, k, v, lengths, tables, new_k, new_v, scalars, scale]
    out = np.full(q.shape, np.nan, np.float32)
    expected = None
    if 0 <= layer < layers:
        expected = paged_attention_xla(  # the portable decode path (itself tested against the reference)
            jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), jnp.asarray(tables),
            new_k=jnp.asarray(new_k), new_v=jnp.asarray(new_v), layer=layer,
        )  # fmt: skip
    return operands, out, expected


CODES = [F32, F32, F32, S32, S32, F32, F32, S32, F32]


def call(handler, xla, operands, out, codes=CODES, **frame_options):
    frame = xla.frame([xla.buffer(a, c) for a, c in zip(operands, codes, strict=True)], xla.buffer(out, F32),
                      **frame_options)  # fmt: skip
    return handler.ctypes(ctypes.c_void_p(frame.ctypes.data)) or 0


def test_valid_frame_runs_the_kernel():
    xla = FakeXla()
    operands, out, expected = decode_case()
    assert call(compiled_handler(), xla, operands, out) == 0
    assert xla.errors == []
    np.testing.assert_allclose(out, np.asarray(expected), atol=1e-5)


def test_metadata_reports_the_header_version_not_the_runtime_version():
    """A runtime at 7.99 asks which version the handler was built for: the answer is the
    header's (0.3), so XLA's range check can refuse it; echoing 7.99 defeats that check."""
    xla = FakeXla(runtime_version=(7, 99))
    metadata = xla.array([48, 99, 99, -1, -1, -1])
    extension = xla.array([32, 1, 0, metadata.ctypes.data])
    frame = xla.frame([], xla.array([0] * 6), extension=extension.ctypes.data)
    assert (compiled_handler().ctypes(ctypes.c_void_p(frame.ctypes.data)) or 0) == 0
    words = metadata.view(np.int32)
    assert metadata[1] == 24 and metadata[2] == 0  # api_version.struct_size, extension_start
    assert (words[6], words[7]) == FFI_API_VERSION
    assert words[8] == 0 and metadata[5] == 0  # no traits, stateless


def test_declared_version_is_one_the_installed_header_supports():
    header = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", header).group(1))
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", header).group(1))
    assert FFI_API_VERSION[0] == major and FFI_API_VERSION[1] <= minor


def corrupt(operands, codes, index, array=None, code=None):
    operands, codes = list(operands), list(codes)
    if array is not None:
        operands[index] = array
    if code is not None:
        codes[index] = code
    return operands, codes


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda o, c: corrupt(o, c, 3, code=F32), "argument 3 (lengths) must be int32"),
        (lambda o, c: corrupt(o, c, 0, array=o[0][0]), "argument 0 (q) must be float32 of rank 3"),
        (lambda o, c: corrupt(o, c, 1, array=o[1][:, :1].copy()), "operand shapes disagree"),
        (lambda o, c: corrupt(o, c, 5, array=o[5][:1].copy()), "operand shapes disagree"),
        (lambda o, c: corrupt(o, c, 4, array=o[4][:1].copy()), "operand shapes disagree"),
        (lambda o, c: corrupt(o, c, 8, array=np.ones(2, np.float32)), "scale 1"),
        (lambda o, c: corrupt(o, c, 7, array=np.array([2, 1, 0], np.int32)), "layer index outside"),
        (lambda o, c: corrupt(o, c, 7, array=np.array([-1, 1, 0], np.int32)), "layer index outside"),
        (lambda o, c: (o[:8], c[:8]), "expected 9 arguments and 1 result"),
    ],
)
def test_corrupt_frames_are_refused_before_any_memory_is_read(change, needle):
    xla = FakeXla()
    operands, out, _ = decode_case()
    operands, codes = change(operands, CODES)
    assert call(compiled_handler(), xla, operands, out, codes=codes) == ERROR
    assert len(xla.errors) == 1 and needle in xla.errors[0][0], xla.errors
    assert xla.errors[0][1] == 3  # XLA_FFI_Error_Code_INVALID_ARGUMENT
    assert np.isnan(out).all(), "the kernel ran on a refused frame"


def test_small_call_frame_and_wrong_stage_are_refused():
    xla = FakeXla()
    operands, out, _ = decode_case()
    frame = xla.frame([xla.buffer(a, c) for a, c in zip(operands, CODES, strict=True)], xla.buffer(out, F32))
    frame[0] = 160  # an XLA_FFI_CallFrame older than `attrs`
    assert compiled_handler().ctypes(ctypes.c_void_p(frame.ctypes.data)) == ERROR
    assert call(compiled_handler(), xla, operands, out, stage=1) == ERROR
    assert ["smaller than the 168 bytes" in xla.errors[0][0], "EXECUTE" in xla.errors[1][0]] == [True, True]
    assert np.isnan(out).all()


@numba.njit
def _raising_launch(q, k, v, lengths, tables, new_k, new_v, layer, has_new, window, scale, out):
    raise ValueError("a failure inside the kernel")


def test_exception_in_the_launch_releases_the_lock_and_reports_an_error():
    lock = np.zeros(1, np.int32)
    handler = numba.cfunc(types.voidptr(types.voidptr))(make_handler(_raising_launch, lock.ctypes.data))
    xla = FakeXla()
    operands, out, _ = decode_case()
    for _ in range(2):  # a lock left held would make the second call spin forever
        assert call(handler, xla, operands, out) == ERROR
        assert lock[0] == 0
    assert xla.errors == [("paged_attention_cpu: the kernel raised an exception during the launch", 13)] * 2


def test_traced_layer_out_of_range_raises_instead_of_reading_past_the_cache():
    operands, _, _ = decode_case()
    q, k, v, lengths, tables = (jnp.asarray(a) for a in operands[:5])
    attend = jax.jit(lambda layer: paged_attention_cpu(q, k, v, lengths, tables, layer=layer))
    np.testing.assert_allclose(
        attend(jnp.int32(1)), paged_attention_reference(q, k[1], v[1], lengths, tables), atol=1e-5
    )
    with pytest.raises(Exception, match="layer index outside"):
        attend(jnp.int32(2)).block_until_ready()
    with pytest.raises(Exception, match="layer index outside"):
        attend(jnp.int32(-1)).block_until_ready()
    np.testing.assert_allclose(  # and the kernel still takes launches (the lock is free)
        attend(jnp.int32(0)), paged_attention_reference(q, k[0], v[0], lengths, tables), atol=1e-5
    )
