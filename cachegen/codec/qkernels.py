"""CPU kernels for quantization, reading bfloat16 or float32 KV in place (any strides).

Same arithmetic as the torch reference in ``quant.py`` (float32 multiply, round half to
even, clamp), so both give identical symbols; torch needs about eight passes over the data
and a dtype conversion, these kernels one pass each. Work is split by layer (``todo``) and
runs without the GIL.

Sources are C-contiguous 4-D arrays ``[L, H, n, D]`` of float bits: ``uint16`` for
bfloat16, ``uint32`` for float32 (contiguous, so the loops vectorize: much faster than on
strided views, for a copy that costs less; docs/codec.md, "Speed").

Scale kinds: 0 = per token (over heads and dims), 1 = per token and head, 2 = per channel
(over the tokens of the chunk). Per layer, scales are laid out ``[n]``, ``[H, n]`` or ``[H, D]``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload


@intrinsic
def bits_to_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if bits.bitwidth > 32:
            value = builder.trunc(value, ir.IntType(32))
        elif bits.bitwidth < 32:
            value = builder.zext(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_to_bits(typingctx, value):
    """The bit pattern of a float32 as a uint32."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen


@intrinsic
def prefetch(typingctx, array, index):
    """Hint the CPU to fetch ``array[index]`` (1-D) into cache; never faults."""
    if (
        not isinstance(array, types.Array)
        or array.ndim != 1
        or not isinstance(index, types.Integer)
    ):
        return None

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(
            fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)]
        )  # read, keep in all levels, data
        return context.get_dummy_value()

    return types.void(array, index), codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` on float32, rounded once (what torch's CPU ``addcmul`` computes)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32"
        )
        return builder.call(fn, list(args))

    return types.float32(a, b, c), codegen


@numba.njit(inline="always")
def f32_to_bf16(value):
    """float32 -> bfloat16 bits, rounding to nearest even (what torch does)."""
    u = f32_to_bits(value)
    return np.uint16(
        (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    )


def as_f32(x):  # only meaningful inside kernels (see the overload)
    raise NotImplementedError


@overload(as_f32, inline="always")
def _as_f32(x):
    if x == types.uint16:  # bfloat16 bits
        return lambda x: bits_to_f32(np.uint32(x) << np.uint32(16))
    if x == types.uint32:  # float32 bits
        return lambda x: bits_to_f32(x)
    return None


def abs_bits(x):  # only meaningful inside kernels (see the overload)
    raise NotImplementedError


@overload(abs_bits, inline="always")
def _abs_bits(x):
    """|x| of bfloat16 or float32 bits, as an integer that orders like the float magnitude."""
    if x == types.uint16:
        return lambda x: np.uint32(x) & np.uint32(0x7FFF)
    if x == types.uint32:
        return lambda x: x & np.uint32(0x7FFFFFFF)
    return None


def float_of_abs_bits(array, bits):  # only meaningful inside kernels (see the overload)
    raise NotImplementedError


@overload(float_of_abs_bits, inline="always")
def _float_of_abs_bits(array, bits):
    if array.dtype == types.uint16:
        return lambda array, bits: bits_to_f32(np.uint32(bits) << np.uint32(16))
    return lambda array, bits: bits_to_f32(np.uint32(bits))


def first_non_finite(array):  # only meaningful inside kernels (see the overload)
    raise NotImplementedError


@overload(first_non_finite, inline="always")
def _first_non_finite(array):
    """The smallest magnitude bit pattern that is inf or NaN."""
    if array.dtype == types.uint16:
        return lambda array: np.uint32(0x7F80)
    return lambda array: np.uint32(0x7F800000)


@numba.njit(inline="always")
def symbol_of(value, inv, level):
    """``clamp(rint(value * inv), -level, level) + level`` as uint8 (value in float32)."""
    q = np.rint(value * inv)
    q = min(max(q, -level), level)
    return np.uint8(q + level)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def amax_layers(x, kind, amax, todo):
    """Absolute maxima of ``x`` [L, H, n, D] per scale group; True if ``x`` has a NaN or inf.

    The maximum is taken over the magnitude bits as integers (exact for IEEE floats, and a
    reduction the compiler vectorizes, unlike a float max with NaN semantics).
    """
    _, H, n, D = x.shape
    per_layer = n if kind == 0 else (H * n if kind == 1 else H * D)
    top = np.zeros(per_layer, dtype=np.uint32)
    worst = np.uint32(0)
    for i in range(todo.shape[0]):
        layer = todo[i]
        top[:] = 0
        for h in range(H):
            for t in range(n):
                if kind == 2:
                    o = h * D
                    for d in range(D):
                        top[o + d] = max(top[o + d], abs_bits(x[layer, h, t, d]))
                else:
                    m = np.uint32(0)
                    for d in range(D):
                        m = max(m, abs_bits(x[layer, h, t, d]))
                    o = t if kind == 0 else h * n + t
                    top[o] = max(top[o], m)
        a0 = layer * per_layer
        for j in range(per_layer):
            worst = max(worst, top[j])
            amax[a0 + j] = float_of_abs_bits(x, top[j])
    return worst >= first_non_finite(x)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def quantize_layers(x, kind, inv, max_level, out, todo):
    """``out[l, h, t, d] = symbol_of(x[l, h, t, d], inv[...], max_level[l])``
    (uint8 [L, H, n, D])."""
    _, H, n, D = x.shape
    per_layer = n if kind == 0 else (H * n if kind == 1 else H * D)
    for i in range(todo.shape[0]):
        layer = todo[i]
        a0 = layer * per_layer
        m = np.float32(max_level[layer])
        for h in range(H):
            for t in range(n):
                if kind == 2:
                    o = a0 + h * D
                    for d in range(D):
                        out[layer, h, t, d] = symbol_of(as_f32(x[layer, h, t, d]), inv[o + d], m)
                else:
                    s = inv[a0 + (t if kind == 0 else h * n + t)]
                    for d in range(D):
                        out[layer, h, t, d] = symbol_of(as_f32(x[layer, h, t, d]), s, m)


# ---- the decoder's last step -----------------------------------------------------------------


@numba.njit(nogil=True, cache=True, boundscheck=False)
def store_rotated(src, cos, sin, rotate, out_f32, out_bf16):
    """Write float32 ``src`` ``[rows, n, D]`` to ``out_bf16`` (bfloat16 bits) if that is
    non-empty, else to ``out_f32`` (same shape, any strides), turned by the rotary angles
    first if ``rotate``.

    ``cos``/``sin`` are ``[n, D]`` as ``quant.rotary_cos_sin`` gives them; the arithmetic is
    ``quant.apply_rotary``'s, bit for bit (torch's CPU kernels fuse the multiply-add, so this
    does too). One pass instead of torch's four (product, two in-place updates, converting
    copy), which is what made decoding the pre-RoPE levels fast (docs/codec.md, "Speed").
    """
    rows, n, D = src.shape
    half = D // 2
    to_bf16 = out_bf16.shape[0] > 0
    for r in range(rows):
        for t in range(n):
            for d in range(half):
                x1 = src[r, t, d]
                x2 = src[r, t, d + half]
                if rotate:
                    y1 = fma32(-x2, sin[t, d], x1 * cos[t, d])
                    y2 = fma32(x1, sin[t, d + half], x2 * cos[t, d + half])
                else:
                    y1, y2 = x1, x2
                if to_bf16:
                    out_bf16[r, t, d] = f32_to_bf16(y1)
                    out_bf16[r, t, d + half] = f32_to_bf16(y2)
                else:
                    out_f32[r, t, d] = y1
                    out_f32[r, t, d + half] = y2
