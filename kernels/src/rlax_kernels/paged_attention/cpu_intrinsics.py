"""LLVM intrinsics for the native CPU kernel (numba ``@intrinsic``): what numba's own types
cannot say -- an integer as a pointer, a float from its bits, a prefetch hint, a spin lock
and a call through a C function pointer.

Addresses travel as integers (``pointer`` turns one into the void pointer ``numba.carray``
takes), so the kernel around them stays ordinary numba code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, cast

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

P = ParamSpec("P")


def _intrinsic(typer: Callable[Concatenate[Any, P], Any]) -> Callable[P, Any]:
    """numba's ``@intrinsic``, typed the way njit code calls it: numba passes ``typingctx``
    itself, while numba's own annotations keep it in the call's signature."""
    return cast(Callable[P, Any], intrinsic(typer))


@_intrinsic
def pointer(typingctx, address):  # type: ignore[no-untyped-def]
    """The int64 `address` as a void pointer."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


@_intrinsic
def float_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """The float32 whose bit pattern is the int32 `bits`."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


@_intrinsic
def prefetch(typingctx, address):  # type: ignore[no-untyped-def]
    """Hint the CPU to load the cache line at `address` (llvm.prefetch: read, keep in all levels)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        byte_ptr, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.inttoptr(args[0], byte_ptr), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(types.intp), codegen


@_intrinsic
def spin_acquire(typingctx, address):  # type: ignore[no-untyped-def]
    """Take the spin lock at `address` (compare-and-swap 0 -> 1, yielding the CPU between tries)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        lock = builder.inttoptr(args[0], i32.as_pointer())
        sched_yield = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, []), "sched_yield")
        retry, taken = builder.append_basic_block("lock_retry"), builder.append_basic_block("lock_taken")
        builder.branch(retry)
        builder.position_at_end(retry)
        swapped = builder.extract_value(builder.cmpxchg(lock, i32(0), i32(1), "acquire", "monotonic"), 1)
        with builder.if_then(builder.not_(swapped)):
            builder.call(sched_yield, [])
        builder.cbranch(swapped, taken, retry)
        builder.position_at_end(taken)
        return context.get_dummy_value()

    return types.void(types.intp), codegen


@_intrinsic
def spin_release(typingctx, address):  # type: ignore[no-untyped-def]
    """Free the spin lock at `address`."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i32 = ir.IntType(32)
        builder.store_atomic(i32(0), builder.inttoptr(args[0], i32.as_pointer()), "release", 4)
        return context.get_dummy_value()

    return types.void(types.intp), codegen


@_intrinsic
def call_pointer(typingctx, function, argument):  # type: ignore[no-untyped-def]
    """Call the C function at address `function` as ``void *f(void *)`` with `argument`; its result as int64."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        i64 = ir.IntType(64)
        function_type = ir.FunctionType(cgutils.voidptr_t, [cgutils.voidptr_t])
        target = builder.inttoptr(args[0], function_type.as_pointer())
        result = builder.call(target, [builder.inttoptr(args[1], cgutils.voidptr_t)])
        return builder.ptrtoint(result, i64)

    return types.int64(types.int64, types.int64), codegen
