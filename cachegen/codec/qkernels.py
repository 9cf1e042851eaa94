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


@numba.njit(inline="always")
def hadamard_row(v, head_dim, inv_sqrt):
    """``v[:head_dim]`` times the orthonormal Sylvester Hadamard matrix, in place: butterflies
    of span 1, 2, 4, ... (a fast Walsh-Hadamard transform, ``head_dim`` a power of two), then
    one multiply by ``inv_sqrt`` (float32 ``1 / sqrt(head_dim)``). The matrix is symmetric, so
    this is also its inverse; it rounds like no dense product does, so both forms of a level
    call it (the coded form on its float32 scratch, the packed form on each row).

    Spans 1, 2 and 4 run on eight values in registers, the wider ones eight lanes at a time
    (the same additions in the same order, in fewer instructions)."""
    span = 1
    if head_dim % 8 == 0:
        for g in range(0, head_dim, 8):
            _hadamard8(v, g)
        span = 8
    while span < head_dim:
        for first in range(0, head_dim, 2 * span):
            if span % 8 == 0:
                for j in range(first, first + span, 8):
                    _butterfly8(v, j, j + span)
            else:
                for j in range(first, first + span):
                    a = v[j]
                    b = v[j + span]
                    v[j] = a + b
                    v[j + span] = a - b
        span *= 2
    for j in range(head_dim):
        v[j] *= inv_sqrt


@numba.njit(inline="always")
def _hadamard8(v, g):
    """Butterflies of span 1, 2 and 4 on ``v[g : g + 8]``."""
    a0, a1, a2, a3 = v[g], v[g + 1], v[g + 2], v[g + 3]
    a4, a5, a6, a7 = v[g + 4], v[g + 5], v[g + 6], v[g + 7]
    b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
    b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
    c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
    c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
    v[g], v[g + 1], v[g + 2], v[g + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
    v[g + 4], v[g + 5], v[g + 6], v[g + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7


@numba.njit(inline="always")
def _butterfly8(v, p, q):
    """``(v[p + i], v[q + i]) = (a + b, a - b)`` for ``i < 8``: every load before every store,
    so the compiler can use vector operations (it cannot tell that the ranges are apart)."""
    a0 = v[p + 0]
    a1 = v[p + 1]
    a2 = v[p + 2]
    a3 = v[p + 3]
    a4 = v[p + 4]
    a5 = v[p + 5]
    a6 = v[p + 6]
    a7 = v[p + 7]
    b0 = v[q + 0]
    b1 = v[q + 1]
    b2 = v[q + 2]
    b3 = v[q + 3]
    b4 = v[q + 4]
    b5 = v[q + 5]
    b6 = v[q + 6]
    b7 = v[q + 7]
    v[p + 0] = a0 + b0
    v[p + 1] = a1 + b1
    v[p + 2] = a2 + b2
    v[p + 3] = a3 + b3
    v[p + 4] = a4 + b4
    v[p + 5] = a5 + b5
    v[p + 6] = a6 + b6
    v[p + 7] = a7 + b7
    v[q + 0] = a0 - b0
    v[q + 1] = a1 - b1
    v[q + 2] = a2 - b2
    v[q + 3] = a3 - b3
    v[q + 4] = a4 - b4
    v[q + 5] = a5 - b5
    v[q + 6] = a6 - b6
    v[q + 7] = a7 - b7


@numba.njit(inline="always")
def _turn(x1, x2, cos1, sin1, cos2, sin2):
    """Channels ``d`` and ``d + D/2`` turned by their rotary angles: ``quant.apply_rotary``'s
    arithmetic, bit for bit (torch's CPU kernels fuse the multiply-add, so this does too)."""
    return fma32(-x2, sin1, x1 * cos1), fma32(x1, sin2, x2 * cos2)


@numba.njit(inline="always")
def store_row(v, cos, sin, t, rotate, head_dim, out_f32, out_bf16, o):
    """Write float32 ``v[:head_dim]`` to ``out_bf16[o : o + head_dim]`` (bfloat16 bits) if that
    is non-empty, else to ``out_f32``, turned by the rotary angles of row ``t`` of ``cos`` /
    ``sin`` first if ``rotate``."""
    half = head_dim // 2
    to_bf16 = out_bf16.shape[0] > 0
    for d in range(half):
        x1 = v[d]
        x2 = v[d + half]
        if rotate:
            x1, x2 = _turn(x1, x2, cos[t, d], sin[t, d], cos[t, d + half], sin[t, d + half])
        if to_bf16:
            out_bf16[o + d] = f32_to_bf16(x1)
            out_bf16[o + d + half] = f32_to_bf16(x2)
        else:
            out_f32[o + d] = x1
            out_f32[o + d + half] = x2


@numba.njit(nogil=True, cache=True, boundscheck=False)
def store_transformed(src, hadamard, cos, sin, rotate, out_f32, out_bf16):
    """Write float32 ``src`` ``[rows, n, D]`` to ``out_bf16`` (bfloat16 bits) if that is
    non-empty, else to ``out_f32`` (same shape, any strides): each row times the Hadamard
    matrix (:func:`hadamard_row`) if ``hadamard``, then turned by the rotary angles if
    ``rotate`` (:func:`store_row`'s arithmetic).

    ``cos``/``sin`` are ``[n, D]`` as ``quant.rotary_cos_sin`` gives them. One pass instead of
    torch's product and four rotary passes (docs/codec.md, "Speed").
    """
    rows, n, D = src.shape
    half = D // 2
    to_bf16 = out_bf16.shape[0] > 0
    inv_sqrt = np.float32(1.0 / np.sqrt(np.float64(D)))
    v = np.empty(D, dtype=np.float32)
    for r in range(rows):
        for t in range(n):
            for d in range(D):
                v[d] = src[r, t, d]
            if hadamard:
                hadamard_row(v, D, inv_sqrt)
            for d in range(half):
                x1 = v[d]
                x2 = v[d + half]
                if rotate:
                    x1, x2 = _turn(x1, x2, cos[t, d], sin[t, d], cos[t, d + half], sin[t, d + half])
                if to_bf16:
                    out_bf16[r, t, d] = f32_to_bf16(x1)
                    out_bf16[r, t, d + half] = f32_to_bf16(x2)
                else:
                    out_f32[r, t, d] = x1
                    out_f32[r, t, d + half] = x2


@numba.njit(nogil=True, cache=True, boundscheck=False)
def store_rotated(src, cos, sin, rotate, out_f32, out_bf16):
    """:func:`store_transformed` without the Hadamard product: ``quant.apply_rotary`` bit for
    bit."""
    store_transformed(src, False, cos, sin, rotate, out_f32, out_bf16)
