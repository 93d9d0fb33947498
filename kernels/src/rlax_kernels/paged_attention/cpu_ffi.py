"""XLA's typed-FFI call frame, as the native CPU kernel's handler reads it.

The handler is a numba ``cfunc`` that XLA calls with a ``XLA_FFI_CallFrame*``. Nothing on
that path is checked by a compiler against XLA's header, so everything is checked here,
before any buffer is read:

- The version handshake: XLA asks each handler (through the metadata extension) which FFI
  API version it was built against and refuses one outside the range its runtime supports.
  The answer is `FFI_API_VERSION`, the version of the header whose layouts the offsets
  below follow -- never the runtime's own version, which would pass any runtime.
- The call frame: its size, the execution stage, the number and kinds of arguments and
  results, and every buffer's struct size, dtype, rank and dimensions against the others
  (the kernel indexes raw memory by them), and the traced ``layer`` index against the
  pages' layer axis.
- A failure is reported to XLA as an ``XLA_FFI_Error`` (``XLA_FFI_Error_Create``), which
  JAX raises in Python with the message below; an exception inside the launch is reported
  the same way, after the launch lock is released.

Layouts: ``xla/ffi/api/c_api.h`` in ``jax.ffi.include_dir()``; offsets are 8-byte words.
"""

from __future__ import annotations

from collections.abc import Callable

import numba
import numpy as np
from numba.np.numpy_support import carray

from rlax_kernels.paged_attention.cpu_intrinsics import call_pointer, pointer, spin_acquire, spin_release

# XLA_FFI_API_MAJOR / XLA_FFI_API_MINOR of the c_api.h (jaxlib 0.10.2) these layouts were read from.
FFI_API_VERSION = (0, 3)

# XLA_FFI_*_STRUCT_SIZE (bytes) of the structs read or written here.
_CALL_FRAME_SIZE = 168  # up to `attrs`
_ARGS_SIZE = 40  # XLA_FFI_Args and XLA_FFI_Rets
_BUFFER_SIZE = 48
_API_VERSION_SIZE = 24
_METADATA_EXTENSION_SIZE = 32
_METADATA_SIZE = 36  # up to `traits`
_ERROR_CREATE_ARGS_SIZE = 28
_API_SIZE_FOR_ERRORS = 56  # XLA_FFI_Api up to XLA_FFI_Error_Create

# Word offsets.
_FRAME_EXTENSION, _FRAME_API, _FRAME_STAGE = 1, 2, 4  # XLA_FFI_CallFrame
_FRAME_ARGS, _FRAME_RETS = 5, 10  # its XLA_FFI_Args / XLA_FFI_Rets: struct_size, ext, size, types, pointers
_FRAME_WORDS = 21
_BUFFER_DTYPE, _BUFFER_DATA, _BUFFER_RANK, _BUFFER_DIMS = 2, 3, 4, 5  # XLA_FFI_Buffer
_EXTENSION_TYPE, _EXTENSION_METADATA = 1, 3  # XLA_FFI_Metadata_Extension
_API_ERROR_CREATE = 6  # XLA_FFI_Api.XLA_FFI_Error_Create

_EXTENSION_METADATA_TYPE = 1  # XLA_FFI_Extension_Metadata
_STAGE_EXECUTE = 3  # XLA_FFI_ExecutionStage_EXECUTE
_KIND_BUFFER = 1  # XLA_FFI_ArgType_BUFFER, XLA_FFI_RetType_BUFFER
_F32, _S32 = 11, 4  # XLA_FFI_DataType
_INVALID_ARGUMENT, _INTERNAL = 3, 13  # XLA_FFI_Error_Code

# The kernel's operands, in call order, with the dtype and rank each must have.
ARGUMENTS = (
    "q",
    "k_pages",
    "v_pages",
    "lengths",
    "block_tables",
    "new_k",
    "new_v",
    "layer_has_new_window",
    "scale",
)
_ARG_DTYPES = np.array([_F32, _F32, _F32, _S32, _S32, _F32, _F32, _S32, _F32], np.int64)
_ARG_RANKS = np.array([3, 5, 5, 1, 2, 3, 3, 1, 1], np.int64)
_NUM_ARGS = len(ARGUMENTS)

# Error codes: an index into MESSAGES (0 = no error).
_FRAME_TOO_SMALL, _WRONG_STAGE, _WRONG_COUNT, _NOT_BUFFERS, _BUFFER_TOO_SMALL = 1, 2, 3, 4, 5
_BAD_SHAPES, _BAD_SCALARS, _LAYER_OUT_OF_RANGE, _METADATA_TOO_SMALL, _LAUNCH_RAISED, _BAD_RESULT = range(
    6, 12
)
_ARG_BASE = 16  # + argument index: that argument's dtype or rank is wrong
_DTYPE_NAMES = {_F32: "float32", _S32: "int32"}
MESSAGES = {
    _FRAME_TOO_SMALL: f"the XLA_FFI_CallFrame is smaller than the {_CALL_FRAME_SIZE} bytes of FFI API "
    f"{FFI_API_VERSION[0]}.{FFI_API_VERSION[1]}",
    _WRONG_STAGE: "called at an execution stage other than EXECUTE",
    _WRONG_COUNT: f"expected {_NUM_ARGS} arguments and 1 result",
    _NOT_BUFFERS: "every argument and the result must be a buffer",
    _BUFFER_TOO_SMALL: f"an XLA_FFI_Buffer is smaller than {_BUFFER_SIZE} bytes",
    _BAD_SHAPES: "operand shapes disagree: q [B, H, D], pages [L, KVH, P, PS, D] with H a multiple of "
    "KVH, lengths [B], block_tables [B, W], new_k and new_v [B, KVH, D]",
    _BAD_SCALARS: "layer_has_new_window must have 3 entries and scale 1",
    _LAYER_OUT_OF_RANGE: "layer index outside the pages' layer axis (or has_new not 0/1, or window < 0)",
    _METADATA_TOO_SMALL: "the metadata extension or XLA_FFI_Metadata is too small for FFI API "
    f"{FFI_API_VERSION[0]}.{FFI_API_VERSION[1]}",
    _LAUNCH_RAISED: "the kernel raised an exception during the launch",
    _BAD_RESULT: "the result must be float32 [B, H, D] like q",
    **{
        _ARG_BASE + i: f"argument {i} ({name}) must be {_DTYPE_NAMES[int(dtype)]} of rank {rank}"
        for i, (name, dtype, rank) in enumerate(zip(ARGUMENTS, _ARG_DTYPES, _ARG_RANKS, strict=True))
    },
}
# NUL-terminated copies that live as long as the process (XLA copies a message when it
# creates the error); the handler reads their addresses from this table.
_MESSAGE_BYTES = {
    code: np.frombuffer(f"paged_attention_cpu: {text}".encode() + b"\0", np.uint8).copy()
    for code, text in MESSAGES.items()
}
_MESSAGE_ADDRESSES = np.zeros(max(MESSAGES) + 1, np.int64)
for _code, _text in _MESSAGE_BYTES.items():
    _MESSAGE_ADDRESSES[_code] = _text.ctypes.data


@numba.njit(inline="always")
def _words(address, n):  # type: ignore[no-untyped-def]
    return carray(pointer(address), n, np.int64)


@numba.njit
def _error(api, code):  # type: ignore[no-untyped-def]
    """An XLA_FFI_Error* (as int64) carrying message `code`, made by the runtime's XLA_FFI_Error_Create.

    0 -- which XLA reads as success -- only when the frame holds no usable API to report with.
    """
    if api == 0 or _words(api, 1)[0] < _API_SIZE_FOR_ERRORS:
        return np.int64(0)
    create_args = np.zeros(4, np.int64)  # XLA_FFI_Error_Create_Args
    create_args[0] = _ERROR_CREATE_ARGS_SIZE
    create_args[2] = _MESSAGE_ADDRESSES[code]
    create_args[3] = _INTERNAL if code == _LAUNCH_RAISED else _INVALID_ARGUMENT
    return call_pointer(_words(api, _API_ERROR_CREATE + 1)[_API_ERROR_CREATE], create_args.ctypes.data)


@numba.njit
def _answer_metadata(extension):  # type: ignore[no-untyped-def]
    """Fill XLA's metadata query: the header's API version, no traits, stateless. Returns an error code."""
    ext = _words(extension, 4)
    if ext[0] < _METADATA_EXTENSION_SIZE or ext[_EXTENSION_METADATA] == 0:
        return _METADATA_TOO_SMALL
    metadata = ext[_EXTENSION_METADATA]
    size = _words(metadata, 1)[0]
    if size < _METADATA_SIZE:
        return _METADATA_TOO_SMALL
    words = _words(metadata, 4)
    words[1] = _API_VERSION_SIZE  # api_version.struct_size
    words[2] = 0  # api_version.extension_start
    ints = carray(pointer(metadata), 9, np.int32)
    ints[6] = FFI_API_VERSION[0]  # api_version.major_version (byte 24)
    ints[7] = FFI_API_VERSION[1]  # api_version.minor_version (byte 28)
    ints[8] = 0  # traits (byte 32): none
    if size >= 48:
        _words(metadata, 6)[5] = 0  # state_type_id: XLA_FFI_UNKNOWN_TYPE_ID (stateless)
    return 0


@numba.njit
def _buffer_header(address):  # type: ignore[no-untyped-def]
    """(struct_size, dtype, data address, rank) of an XLA_FFI_Buffer."""
    words = _words(address, 6)
    return words[0], words[_BUFFER_DTYPE] & 0xFFFFFFFF, words[_BUFFER_DATA], words[_BUFFER_RANK]


@numba.njit
def _dims(address):  # type: ignore[no-untyped-def]
    words = _words(address, 6)
    return carray(pointer(words[_BUFFER_DIMS]), words[_BUFFER_RANK], np.int64)


@numba.njit
def check_frame(frame):  # type: ignore[no-untyped-def]
    """Error code (0 = fine) of an EXECUTE call frame: `frame` is its first `_FRAME_WORDS` words."""
    if frame[_FRAME_STAGE] & 0xFFFFFFFF != _STAGE_EXECUTE:
        return _WRONG_STAGE
    if frame[_FRAME_ARGS] < _ARGS_SIZE or frame[_FRAME_RETS] < _ARGS_SIZE:
        return _FRAME_TOO_SMALL
    if frame[_FRAME_ARGS + 2] != _NUM_ARGS or frame[_FRAME_RETS + 2] != 1:
        return _WRONG_COUNT
    if frame[_FRAME_ARGS + 3] == 0 or frame[_FRAME_ARGS + 4] == 0 or frame[_FRAME_RETS + 4] == 0:
        return _NOT_BUFFERS
    arg_kinds = carray(pointer(frame[_FRAME_ARGS + 3]), _NUM_ARGS, np.int32)
    if frame[_FRAME_RETS + 3] == 0 or carray(pointer(frame[_FRAME_RETS + 3]), 1, np.int32)[0] != _KIND_BUFFER:
        return _NOT_BUFFERS
    args = _words(frame[_FRAME_ARGS + 4], _NUM_ARGS)
    result = _words(frame[_FRAME_RETS + 4], 1)[0]
    for i in range(_NUM_ARGS):
        if arg_kinds[i] != _KIND_BUFFER or args[i] == 0:
            return _NOT_BUFFERS
        size, dtype, _, rank = _buffer_header(args[i])
        if size < _BUFFER_SIZE:
            return _BUFFER_TOO_SMALL
        if dtype != _ARG_DTYPES[i] or rank != _ARG_RANKS[i]:
            return _ARG_BASE + i
    if result == 0:
        return _NOT_BUFFERS
    size, dtype, _, rank = _buffer_header(result)
    if size < _BUFFER_SIZE:
        return _BUFFER_TOO_SMALL
    q, k, v = _dims(args[0]), _dims(args[1]), _dims(args[2])
    lengths, tables, new_k, new_v = _dims(args[3]), _dims(args[4]), _dims(args[5]), _dims(args[6])
    if (
        dtype != _F32
        or rank != 3
        or _dims(result)[0] != q[0]
        or _dims(result)[1] != q[1]
        or _dims(result)[2] != q[2]
    ):
        return _BAD_RESULT
    for axis in range(5):
        if k[axis] != v[axis] or k[axis] < 0:
            return _BAD_SHAPES
    batch, heads, head_dim, kv_heads = q[0], q[1], q[2], k[1]
    if kv_heads < 1 or heads % kv_heads != 0 or k[4] != head_dim or lengths[0] != batch or tables[0] != batch:
        return _BAD_SHAPES
    for extra in (new_k, new_v):
        if extra[0] != batch or extra[1] != kv_heads or extra[2] != head_dim:
            return _BAD_SHAPES
    if _dims(args[7])[0] != 3 or _dims(args[8])[0] != 1:
        return _BAD_SCALARS
    scalars = carray(pointer(_buffer_header(args[7])[2]), 3, np.int32)
    if not 0 <= scalars[0] < k[0] or not 0 <= scalars[1] <= 1 or scalars[2] < 0:
        return _LAYER_OUT_OF_RANGE
    return 0


def make_handler(launch: Callable[..., None], lock_address: int) -> Callable[..., object]:
    """The FFI handler (to compile with ``numba.cfunc(voidptr(voidptr))``) that checks the
    frame, then runs ``launch(q, k, v, lengths, tables, new_k, new_v, layer, has_new, window, scale, out)``
    (a numba function) under the spin lock at `lock_address`, released even if it raises."""

    @numba.njit
    def run(args, out_at):  # type: ignore[no-untyped-def]
        """`launch` on the checked buffers: `args` the frame's argument pointers, `out_at` the result's data."""
        q, k, tables = _dims(args[0]), _dims(args[1]), _dims(args[4])
        batch, num_heads, head_dim, num_kv_heads = q[0], q[1], q[2], k[1]
        cache_shape = (k[0], k[1], k[2], k[3], k[4])
        scalars = carray(pointer(_buffer_header(args[7])[2]), 3, np.int32)
        launch(
            carray(pointer(_buffer_header(args[0])[2]), (batch, num_heads, head_dim), np.float32),
            carray(pointer(_buffer_header(args[1])[2]), cache_shape, np.float32),
            carray(pointer(_buffer_header(args[2])[2]), cache_shape, np.float32),
            carray(pointer(_buffer_header(args[3])[2]), batch, np.int32),
            carray(pointer(_buffer_header(args[4])[2]), (batch, tables[1]), np.int32),
            carray(pointer(_buffer_header(args[5])[2]), (batch, num_kv_heads, head_dim), np.float32),
            carray(pointer(_buffer_header(args[6])[2]), (batch, num_kv_heads, head_dim), np.float32),
            scalars[0],
            scalars[1] != 0,
            scalars[2],
            carray(pointer(_buffer_header(args[8])[2]), 1, np.float32)[0],
            carray(pointer(out_at), (batch, num_heads, head_dim), np.float32),
        )

    def handler(frame_ptr):  # type: ignore[no-untyped-def]
        head = carray(frame_ptr, 3, np.int64)
        if head[0] < (_FRAME_API + 1) * 8:
            return pointer(0)  # not even an API to report through
        api = head[_FRAME_API]
        if head[0] < _CALL_FRAME_SIZE:
            return pointer(_error(api, _FRAME_TOO_SMALL))
        frame = carray(frame_ptr, _FRAME_WORDS, np.int64)
        extension = frame[_FRAME_EXTENSION]
        if extension != 0 and _words(extension, 2)[_EXTENSION_TYPE] & 0xFFFFFFFF == _EXTENSION_METADATA_TYPE:
            code = _answer_metadata(extension)
            return pointer(_error(api, code) if code else np.int64(0))
        code = check_frame(frame)
        if code:
            return pointer(_error(api, code))
        args = _words(frame[_FRAME_ARGS + 4], _NUM_ARGS)
        out_at = _buffer_header(_words(frame[_FRAME_RETS + 4], 1)[0])[2]
        failed = False
        spin_acquire(lock_address)  # XLA may run two programs at once; workqueue takes one launch
        try:
            run(args, out_at)
        except Exception:  # any exception: free the lock, then report it
            failed = True
        spin_release(lock_address)
        return pointer(_error(api, _LAUNCH_RAISED) if failed else np.int64(0))

    return handler
