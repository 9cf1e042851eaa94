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


def item_pointer(context, builder, array_type, array, *index):
    """LLVM: a pointer to element ``index`` of ``array`` (no bounds check, no wraparound)."""
    ary = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(
        context, builder, array_type, ary, list(index), wraparound=False
    )


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
        ptr = item_pointer(context, builder, signature.args[0], args[0], args[1])
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
    if x == types.float32:
        return lambda x: x
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


VECTOR_HEAD_DIMS = (32, 64, 128, 256)  # the head dims whose rows run in vector registers


def _for_head_dim(context, builder, head_dim, head_dim_type, emit):
    """LLVM: ``emit(n)`` for the ``n`` of ``VECTOR_HEAD_DIMS`` that equals ``head_dim`` (a
    switch, folded away where the head dim is a constant); an i1, true if one did."""
    size = context.cast(builder, head_dim, head_dim_type, types.int64)
    end = builder.append_basic_block("head_dim.end")
    other = builder.append_basic_block("head_dim.other")
    switch = builder.switch(size, other)
    done = []
    for n in VECTOR_HEAD_DIMS:
        block = builder.append_basic_block(f"head_dim.{n}")
        switch.add_case(ir.Constant(size.type, n), block)
        builder.position_at_end(block)
        emit(n)
        done.append(builder.block)
        builder.branch(end)
    builder.position_at_end(other)
    builder.branch(end)
    builder.position_at_end(end)
    flag = builder.phi(ir.IntType(1))
    for block in done:
        flag.add_incoming(ir.IntType(1)(1), block)
    flag.add_incoming(ir.IntType(1)(0), other)
    return flag


def _is_row(v):
    """Whether numba type ``v`` is a row the vector kernels take: 1-D C-contiguous float32."""
    return isinstance(v, types.Array) and (v.ndim, v.layout, v.dtype) == (1, "C", types.float32)


@intrinsic
def hadamard_vector(typingctx, v, head_dim, inv_sqrt):
    """:func:`hadamard_row` with the row in vector registers, for a head dim of
    ``VECTOR_HEAD_DIMS``; returns False (and does nothing) for any other. A row written and
    read back per butterfly stage costs several times the arithmetic. Each stage gathers the
    pairs ``(i, i + span)`` with shuffles, then adds and subtracts them: the same operations in
    the same order as the butterflies. ``v`` is C-contiguous."""
    if not _is_row(v) or not isinstance(head_dim, types.Integer) or inv_sqrt != types.float32:
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data

        def emit(n):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            row = ir.VectorType(f32, n)
            ptr = builder.bitcast(data, row.as_pointer())
            x = builder.load(ptr, align=4)
            span = 1
            while span < n:
                low = [i for i in range(n) if not i & span]  # the first of each pair
                at = {i: p for p, i in enumerate(low)}
                a = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(i32, n // 2), low))
                high = ir.Constant(ir.VectorType(i32, n // 2), [i + span for i in low])
                b = builder.shuffle_vector(x, x, high)
                back = [n // 2 + at[i - span] if i & span else at[i] for i in range(n)]
                x = builder.shuffle_vector(
                    builder.fadd(a, b), builder.fsub(a, b), ir.Constant(ir.VectorType(i32, n), back)
                )
                span *= 2
            lane = builder.insert_element(ir.Constant(row, ir.Undefined), args[2], i32(0))
            scale = builder.shuffle_vector(lane, lane, ir.Constant(ir.VectorType(i32, n), [0] * n))
            builder.store(builder.fmul(x, scale), ptr, align=4)

        return _for_head_dim(context, builder, args[1], signature.args[1], emit)

    return types.boolean(v, head_dim, inv_sqrt), codegen


@numba.njit(inline="always")
def hadamard_row(v, head_dim, inv_sqrt):
    """``v[:head_dim]`` times the orthonormal Sylvester Hadamard matrix, in place: butterflies
    of span 1, 2, 4, ... (a fast Walsh-Hadamard transform, ``head_dim`` a power of two), then
    one multiply by ``inv_sqrt`` (float32 ``1 / sqrt(head_dim)``). The matrix is symmetric, so
    this is also its inverse; it rounds like no dense product does, so both forms of a level
    call it (the coded form on its float32 scratch, the packed form on each row).

    ``v`` is C-contiguous. The common head dims run in vector registers
    (:func:`hadamard_vector`), the others in a loop: the same additions in the same order."""
    if hadamard_vector(v, head_dim, inv_sqrt):
        return
    span = 1
    while span < head_dim:
        for first in range(0, head_dim, 2 * span):
            for j in range(first, first + span):
                a = v[j]
                b = v[j + span]
                v[j] = a + b
                v[j + span] = a - b
        span *= 2
    for j in range(head_dim):
        v[j] *= inv_sqrt


@numba.njit(inline="always")
def _turn(x1, x2, cos1, sin1, cos2, sin2):
    """Channels ``d`` and ``d + D/2`` turned by their rotary angles: ``rotary.apply_rotary``'s
    arithmetic, bit for bit (torch's CPU kernels fuse the multiply-add, so this does too)."""
    return fma32(-x2, sin1, x1 * cos1), fma32(x1, sin2, x2 * cos2)


def vector_bf16_bits(builder, values):
    """LLVM: float32 vector ``values`` -> bfloat16 bits (an i16 vector), rounding to nearest
    even: :func:`f32_to_bf16` lane by lane."""
    i32 = ir.IntType(32)
    lanes = values.type.count
    bits = builder.bitcast(values, ir.VectorType(i32, lanes))
    sixteen = ir.Constant(ir.VectorType(i32, lanes), [16] * lanes)
    odd = builder.and_(builder.lshr(bits, sixteen), ir.Constant(bits.type, [1] * lanes))
    rounded = builder.add(builder.add(bits, ir.Constant(bits.type, [0x7FFF] * lanes)), odd)
    return builder.trunc(builder.lshr(rounded, sixteen), ir.VectorType(ir.IntType(16), lanes))


def _store_vector(turn: bool):
    """An intrinsic ``(v, cos, sin, t, head_dim, out, at)``: :func:`store_row` of a row of
    ``head_dim`` values into ``out`` (C-contiguous float32, or uint16 for bfloat16 bits),
    turned by row ``t`` of ``cos`` / ``sin`` if ``turn``, in vector registers; False (and
    nothing done) for a head dim not in ``VECTOR_HEAD_DIMS``. The arithmetic of
    :func:`_turn` and :func:`f32_to_bf16`, lane by lane."""

    @intrinsic
    def store_vector(typingctx, v, cos, sin, t, head_dim, out, at):
        angles = all(
            isinstance(a, types.Array) and (a.ndim, a.layout, a.dtype) == (2, "C", types.float32)
            for a in (cos, sin)
        )
        if (
            not _is_row(v)
            or not angles
            or not isinstance(out, types.Array)
            or (out.ndim, out.layout) != (1, "C")
            or out.dtype not in (types.float32, types.uint16)
            or not all(isinstance(i, types.Integer) for i in (t, head_dim, at))
        ):
            return None

        def codegen(context, builder, signature, args):
            v_ty, cos_ty, sin_ty, _, head_dim_ty, out_ty, _ = signature.args
            f32, i32 = ir.FloatType(), ir.IntType(32)

            def emit(n):
                half = n // 2

                def load(ptr):
                    return builder.load(
                        builder.bitcast(ptr, ir.VectorType(f32, n).as_pointer()), align=4
                    )

                def part(x, first):
                    lanes = ir.Constant(ir.VectorType(i32, half), list(range(first, first + half)))
                    return builder.shuffle_vector(x, x, lanes)

                row = load(item_pointer(context, builder, v_ty, args[0], ir.IntType(64)(0)))
                if turn:
                    zero = context.get_constant(types.intp, 0)
                    c = load(item_pointer(context, builder, cos_ty, args[1], args[3], zero))
                    s = load(item_pointer(context, builder, sin_ty, args[2], args[3], zero))
                    vector = ir.VectorType(f32, half)
                    fma = cgutils.get_or_insert_function(
                        builder.module,
                        ir.FunctionType(vector, [vector] * 3),
                        f"llvm.fma.v{half}f32",
                    )
                    x1, x2 = part(row, 0), part(row, half)
                    y1 = builder.call(
                        fma, [builder.fneg(x2), part(s, 0), builder.fmul(x1, part(c, 0))]
                    )
                    y2 = builder.call(fma, [x1, part(s, half), builder.fmul(x2, part(c, half))])
                    whole = ir.Constant(ir.VectorType(i32, n), list(range(n)))
                    row = builder.shuffle_vector(y1, y2, whole)
                if out_ty.dtype == types.uint16:
                    row = vector_bf16_bits(builder, row)
                ptr = item_pointer(context, builder, out_ty, args[5], args[6])
                builder.store(row, builder.bitcast(ptr, row.type.as_pointer()), align=2)

            return _for_head_dim(context, builder, args[4], head_dim_ty, emit)

        return types.boolean(v, cos, sin, t, head_dim, out, at), codegen

    return store_vector


store_vector = _store_vector(False)
turn_store_vector = _store_vector(True)


def store_value(out, at, value):  # only meaningful inside kernels (see the overload)
    raise NotImplementedError


@overload(store_value, inline="always")
def _store_value(out, at, value):
    """``out[at] = value``: float32, or bfloat16 bits (:func:`f32_to_bf16`) if ``out`` is
    uint16, or an integer-valued ``value`` as int16 if ``out`` is int16."""
    if out.dtype == types.uint16:

        def store_bf16(out, at, value):
            out[at] = f32_to_bf16(np.float32(value))

        return store_bf16
    if out.dtype == types.int16:

        def store_int16(out, at, value):
            out[at] = np.int16(value)

        return store_int16

    def store_f32(out, at, value):
        out[at] = value

    return store_f32


@numba.njit(inline="always")
def store_row(v, cos, sin, t, rotate, head_dim, out_f32, out_bf16, o):
    """Write float32 ``v[:head_dim]`` (C-contiguous) to ``out_bf16[o : o + head_dim]``
    (bfloat16 bits) if that is non-empty, else to ``out_f32``, turned by the rotary angles of
    row ``t`` of ``cos`` / ``sin`` first if ``rotate``."""
    if out_bf16.shape[0] > 0:
        _store_row_to(v, cos, sin, t, rotate, head_dim, out_bf16, o)
    else:
        _store_row_to(v, cos, sin, t, rotate, head_dim, out_f32, o)


@numba.njit(inline="always")
def _store_row_to(v, cos, sin, t, rotate, head_dim, out, o):
    """:func:`store_row` into ``out`` (float32, or uint16 for bfloat16 bits); the common head
    dims in vector registers (:func:`store_vector`)."""
    if rotate:
        if turn_store_vector(v, cos, sin, t, head_dim, out, o):
            return
    elif store_vector(v, cos, sin, t, head_dim, out, o):
        return
    half = head_dim // 2
    for d in range(half):
        x1 = v[d]
        x2 = v[d + half]
        if rotate:
            x1, x2 = _turn(x1, x2, cos[t, d], sin[t, d], cos[t, d + half], sin[t, d + half])
        store_value(out, o + d, x1)
        store_value(out, o + d + half, x2)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def store_transformed(src, hadamard, cos, sin, rotate, out_f32, out_bf16):
    """Write float32 ``src`` ``[rows, n, D]`` to ``out_bf16`` (bfloat16 bits) if that is
    non-empty, else to ``out_f32`` (same shape, any strides): each row times the Hadamard
    matrix (:func:`hadamard_row`) if ``hadamard``, then turned by the rotary angles if
    ``rotate`` (:func:`store_row`'s arithmetic).

    ``cos``/``sin`` are ``[n, D]`` as ``rotary.rotary_cos_sin`` gives them. One pass instead of
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
    """:func:`store_transformed` without the Hadamard product: ``rotary.apply_rotary`` bit for
    bit."""
    store_transformed(src, False, cos, sin, rotate, out_f32, out_bf16)
