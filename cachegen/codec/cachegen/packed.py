"""The packed form of a cachegen level: its symbols stored at a fixed width (numba kernels).

A level's quantized symbols can be entropy-coded (``rans.py``, the smallest) or bit-packed
(a few times larger, decoded at memory speed). Both hold the same symbols and scales, so
both decode to the same KV, bit for bit. A packed *stream* holds the symbols of one
(layer, K/V, segment) of a frame in the order ``[heads, tokens, head_dim]``, each in
``width`` bits, the fewest that hold the layer's largest symbol (``2 * max_level``): symbol
``i`` is bits ``[i * width, (i + 1) * width)`` of a little-endian bit string (bit ``j`` is bit
``j % 8`` of byte ``j // 8``), the last byte padded with zero bits. Eight symbols fill
``width`` bytes, so the decoder reads a row of a head's channels eight symbols per load.

Kernels release the GIL; ``cachegen.codec.coding.parallel`` spreads streams over threads. The
layout is also documented in ``docs/bitstream.md``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cachegen.codec.cachegen.kernels import (
    f32_to_bf16,
    hadamard_row,
    hadamard_vector,
    item_pointer,
    store_row,
    store_value,
    vector_bf16_bits,
)
from cachegen.codec.cachegen.quant import max_level


def symbol_width(bins: int) -> int:
    """Bits per packed symbol of a layer with ``bins`` bins (symbols ``0 .. 2 * max_level``)."""
    return (2 * max_level(bins)).bit_length()


def packed_bytes(symbols: np.ndarray | int, width: np.ndarray | int) -> np.ndarray | int:
    """Bytes of a packed stream of ``symbols`` symbols of ``width`` bits."""
    return (symbols * width + 7) // 8


@intrinsic
def load_u64le(typingctx, array, index):
    """The eight bytes ``array[index : index + 8]`` (1-D uint8) as a little-endian uint64, read
    unaligned; the caller keeps the read inside the array."""
    if (
        not isinstance(array, types.Array)
        or array.ndim != 1
        or array.dtype != types.uint8
        or not isinstance(index, types.Integer)
    ):
        return None

    def codegen(context, builder, signature, args):
        return _load_word(context, builder, signature.args[0], args[0], args[1])

    return types.uint64(array, index), codegen


def _load_word(context, builder, array_type, array, index):
    """LLVM: the eight bytes at ``array[index]`` as a little-endian i64, read unaligned."""
    ptr = item_pointer(context, builder, array_type, array, index)
    word = builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
    if not np.little_endian:
        i64 = ir.IntType(64)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(i64, [i64]), "llvm.bswap.i64"
        )
        word = builder.call(fn, [word])
    return word


@intrinsic
def dequantize8(typingctx, stream, index, width, center, step, out, at):
    """Symbols ``0 .. 8`` of the ``width``-bit fields of the eight bytes at ``stream[index]``
    (:func:`load_u64le`), each as ``(s - center) * step`` in float32, written to ``out[at :
    at + 8]``: float32 values, or bfloat16 bits (:func:`qkernels.f32_to_bf16`) if ``out`` is
    uint16 (C-contiguous). Eight lanes at once: the arithmetic of the scalar path, in a few
    instructions."""
    if (
        not isinstance(stream, types.Array)
        or stream.ndim != 1
        or stream.dtype != types.uint8
        or not isinstance(out, types.Array)
        or (out.ndim, out.layout) != (1, "C")
        or out.dtype not in (types.float32, types.uint16)
        or center != types.float32
        or step != types.float32
        or not all(isinstance(i, types.Integer) for i in (index, width, at))
    ):
        return None

    def codegen(context, builder, signature, args):
        stream_ty, _, width_ty, _, _, out_ty, _ = signature.args
        i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
        word = _load_word(context, builder, stream_ty, args[0], args[1])
        w = context.cast(builder, args[2], width_ty, types.uint64)
        mask = builder.sub(builder.shl(i64(1), w), i64(1))
        shifts = builder.mul(_splat(builder, w, 8), _lanes(i64, range(8)))
        fields = builder.and_(
            builder.lshr(_splat(builder, word, 8), shifts), _splat(builder, mask, 8)
        )
        symbols = builder.sitofp(
            builder.trunc(fields, ir.VectorType(i32, 8)), ir.VectorType(f32, 8)
        )
        values = builder.fmul(
            builder.fsub(symbols, _splat(builder, args[3], 8)), _splat(builder, args[4], 8)
        )
        dst = item_pointer(context, builder, out_ty, args[5], args[6])
        if out_ty.dtype == types.uint16:
            values = vector_bf16_bits(builder, values)
        builder.store(values, builder.bitcast(dst, values.type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(stream, index, width, center, step, out, at), codegen


def _lanes(kind, values):
    """A constant LLVM vector of integers of type ``kind``."""
    values = list(values)
    return ir.Constant(ir.VectorType(kind, len(values)), values)


def _splat(builder, value, lanes):
    """An LLVM vector of ``lanes`` copies of ``value``."""
    one = builder.insert_element(
        ir.Constant(ir.VectorType(value.type, lanes), ir.Undefined), value, ir.IntType(32)(0)
    )
    return builder.shuffle_vector(one, one, _lanes(ir.IntType(32), [0] * lanes))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def pack_layers(sym, widths, out, offsets, todo):
    """Pack layers ``todo`` of ``sym`` ``[L, H, n, D]`` (uint8, C-contiguous): layer ``l`` at
    ``widths[l]`` bits per symbol into ``out[offsets[l]:]`` (zeroed by the caller)."""
    flat = sym.reshape(sym.shape[0], -1)
    count = flat.shape[1]
    for i in range(todo.shape[0]):
        layer = todo[i]
        width = np.uint64(widths[layer])
        p = offsets[layer]
        acc = np.uint64(0)
        bits = np.uint64(0)
        for j in range(count):
            acc |= np.uint64(flat[layer, j]) << bits
            bits += width
            if bits >= 8:
                out[p] = np.uint8(acc & np.uint64(0xFF))
                acc >>= np.uint64(8)
                bits -= np.uint64(8)
                p += 1
        if bits:
            out[p] = np.uint8(acc)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _fill_values(lut16, lut32, first, symbols, ctr, step, to_bf16):
    """``lut[first + s]`` = symbol ``s`` dequantized with ``step``: bfloat16 bits into
    ``lut16`` or float32 into ``lut32`` (``rans._emit``'s arithmetic)."""
    for s in range(symbols):
        value = (np.float32(s) - ctr) * step
        if to_bf16:
            lut16[first + s] = f32_to_bf16(value)
        else:
            lut32[first + s] = value


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _field_check(width, largest):
    """Constants that test eight ``width``-bit fields of a word against ``largest`` at once:
    ``(word & even) + add`` carries into a bit of ``carry`` for each even field above
    ``largest`` (``word >> width`` does the odd ones); the gap above an even field is the
    next field, masked off, so no carry reaches a neighbour."""
    mask = np.uint64((1 << width) - 1)
    even = np.uint64(0)
    add = np.uint64(0)
    carry = np.uint64(0)
    for j in range(0, 8, 2):
        even |= mask << np.uint64(j * width)
        add |= (mask - np.uint64(largest)) << np.uint64(j * width)
        carry |= np.uint64(1) << np.uint64(j * width + width)
    return even, add, carry


@numba.njit(inline="always")
def _field(stream, bit, mask):
    """The symbol (``mask``: its width's bits) that starts at bit ``bit`` of ``stream``; a
    field of at most eight bits spans at most two bytes."""
    b = bit >> 3
    x = np.uint64(stream[b])
    if b + 1 < stream.shape[0]:
        x |= np.uint64(stream[b + 1]) << np.uint64(8)
    return np.int64((x >> np.uint64(bit & 7)) & mask)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_row(stream, first, width, head_dim, lut, lb, ls, out, o, spacing, largest, check):
    """Write symbols ``first .. first + head_dim`` of ``stream`` to ``out[o + d * spacing]``,
    symbol ``s`` of dim ``d`` as ``lut[lb + d * ls + s]`` (``check``: :func:`_field_check` of
    ``width`` and ``largest``). Returns non-zero if a symbol is above ``largest``."""
    even, add, carry = check
    mask = np.uint64((1 << width) - 1)
    uw = np.uint64(width)
    bad = np.uint64(0)
    q = (first // 8) * width
    if head_dim % 8 == 0 and q + (head_dim // 8 - 1) * width + 8 <= stream.shape[0]:
        # whole groups of eight symbols, ``width`` bytes each, starting on a byte: one load
        for g in range(head_dim // 8):
            v = load_u64le(stream, q)
            bad |= (((v & even) + add) | (((v >> uw) & even) + add)) & carry
            if ls:  # a table per channel
                for j in range(8):
                    s = np.int64((v >> np.uint64(j * width)) & mask)
                    out[o + (8 * g + j) * spacing] = lut[lb + (8 * g + j) * ls + s]
            else:  # one table for the row: no multiply per symbol
                for j in range(8):
                    s = np.int64((v >> np.uint64(j * width)) & mask)
                    out[o + (8 * g + j) * spacing] = lut[lb + s]
            q += width
        return bad
    for d in range(head_dim):  # any head_dim, and rows at the very end of the stream
        s = _field(stream, (first + d) * width, mask)
        bad |= np.uint64(s > largest)
        out[o + d * spacing] = lut[lb + d * ls + s]
    return bad


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_streams(
    data, byte_off, widths, num_channels, num_tokens, dequantize, transform, todo, status
):
    """Unpack and dequantize streams ``todo``; stream ``k`` is ``data[byte_off[k]:byte_off[k+1]]``
    at ``widths[k]`` bits per symbol, its sizes already checked against the header.

    Dequantization and output placement are ``rans.decode_streams``'s (the same
    ``dequantize`` tuple, same float32 arithmetic, same bfloat16 rounding), so both forms
    write the same bits. A row of one scale (per token, or per token and head) is dequantized
    eight symbols at a time in vector registers (:func:`dequantize8`); with a scale per
    channel, each channel's ``2 ** width`` values are computed once into a table and symbols
    are looked up in it. ``status[k]`` becomes 1 when a symbol is outside the stream's
    alphabet, else 0.

    A level's transforms are undone row by row while the row is in registers or cache (the
    coded form does the same arithmetic in ``qkernels.store_transformed``); ``transform`` is
    ``(hadamard, cos, sin, angle_row)``: every row times the Hadamard matrix if ``hadamard``,
    then, if ``angle_row[k] >= 0``, turned by the rotary angles of rows ``angle_row[k] + t``
    of ``cos`` / ``sin`` (token ``t`` of the stream), then stored. Rows of a transformed
    stream are the tokens of the frame in order (no token
    locality).
    """
    scales, scale_off, scale_stride, center, head_dim, token_map, token_off = dequantize[:7]
    out_f32, out_bf16, out_base, out_token_stride = dequantize[7:]
    hadamard, cos, sin, angle_row = transform
    to_bf16 = out_bf16.shape[0] > 0
    size = 1
    for i in range(todo.shape[0]):
        if scale_stride[todo[i], 2]:
            size = max(size, num_channels[todo[i]] << widths[todo[i]])
    # bfloat16 values go straight to the output; a transformed row needs float32 first
    lut16 = np.empty(size if to_bf16 else 0, dtype=np.uint16)
    lut32 = np.empty(size, dtype=np.float32)
    rows = (
        num_channels,
        num_tokens,
        scale_stride,
        token_map,
        token_off,
        out_base,
        out_token_stride,
    )
    for i in range(todo.shape[0]):
        k = todo[i]
        width = widths[k]
        symbols = 1 << width
        stream = data[byte_off[k] : byte_off[k + 1]]
        ctr = np.float32(center[k])
        transformed = hadamard or angle_row[k] >= 0
        to_lut16 = to_bf16 and not transformed
        if scale_stride[k, 2]:  # a scale per channel: a table of each channel's values
            for j in range(num_channels[k]):
                step = scales[scale_off[k] + j]
                _fill_values(lut16, lut32, j * symbols, symbols, ctr, step, to_lut16)
        steps = (scales, scale_off[k], ctr)
        largest = 2 * center[k]
        if transformed:
            angles = (hadamard, cos, sin, angle_row[k])
            bad = _emit_transformed(
                stream, k, width, head_dim, lut32, steps, out_f32, out_bf16, largest, rows, angles
            )
        elif to_bf16:
            bad = _emit_stream(stream, k, width, head_dim, lut16, steps, out_bf16, largest, rows)
        else:
            bad = _emit_stream(stream, k, width, head_dim, lut32, steps, out_f32, largest, rows)
        status[k] = 1 if bad else 0


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_stream(stream, k, width, head_dim, lut, steps, out, largest, rows):
    """:func:`_emit_rows`; LLVM unrolls a row of a head_dim it knows, so the common ones get
    their own copy."""
    if head_dim == 64:
        return _emit_rows(stream, k, width, 64, lut, steps, out, largest, rows)
    if head_dim == 128:
        return _emit_rows(stream, k, width, 128, lut, steps, out, largest, rows)
    if head_dim == 256:
        return _emit_rows(stream, k, width, 256, lut, steps, out, largest, rows)
    return _emit_rows(stream, k, width, head_dim, lut, steps, out, largest, rows)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _whole_row_at(first, width, head_dim, stream_bytes):
    """The byte of symbol ``first`` if its row is groups of eight symbols that one 8-byte
    load each reads inside the stream (the fast path), else -1."""
    q = (first // 8) * width
    if head_dim % 8 == 0 and q + (head_dim // 8 - 1) * width + 8 <= stream_bytes:
        return q
    return -1


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_row_slowly(stream, k, h, t, width, head_dim, lut, steps, out, o, largest, check, rows):
    """Row ``t`` of head ``h`` of stream ``k`` into ``out[o : o + head_dim]`` where the fast
    path does not go: a scale per channel (values looked up in ``lut``), or a row at the very
    end of the stream or of an odd head_dim (symbol by symbol). Non-zero if a symbol is above
    ``largest``."""
    _, num_tokens, scale_stride, _, _, _, _ = rows
    scales, first_scale, center = steps
    sh, st, sc = scale_stride[k, 0], scale_stride[k, 1], scale_stride[k, 2]
    first = (h * num_tokens[k] + t) * head_dim
    symbols = 1 << width
    if sc:
        lb = h * head_dim * sc * symbols
        return _emit_row(
            stream, first, width, head_dim, lut, lb, sc * symbols, out, o, 1, largest, check
        )
    step = scales[first_scale + h * sh + t * st]
    mask = np.uint64(symbols - 1)
    bad = np.uint64(0)
    for d in range(head_dim):
        s = _field(stream, (first + d) * width, mask)
        bad |= np.uint64(s > largest)
        store_value(out, o + d, (np.float32(s) - center) * step)
    return bad


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_rows(stream, k, width, head_dim, lut, steps, out, largest, rows):
    """Every row of stream ``k`` (``rows``: the placement arguments of ``decode_streams``);
    non-zero if a symbol is above ``largest``.

    A row of one scale is computed eight symbols per load (:func:`dequantize8`). The loop
    body passes no array to a function: each such call would count a reference up and down,
    atomically, per row."""
    num_channels, num_tokens, scale_stride, token_map, token_off, out_base, out_token_stride = rows
    scales, first_scale, center = steps
    T = num_tokens[k]
    sh, st, per_channel = scale_stride[k, 0], scale_stride[k, 1], scale_stride[k, 2]
    check = _field_check(width, largest)
    even, add, carry = check
    uw = np.uint64(width)
    bad = np.uint64(0)
    for h in range(num_channels[k] // head_dim):
        for t in range(T):
            o = out_base[k] + (h * out_token_stride + token_map[token_off[k] + t]) * head_dim
            q = _whole_row_at((h * T + t) * head_dim, width, head_dim, stream.shape[0])
            if per_channel or q < 0:
                bad |= _emit_row_slowly(
                    stream, k, h, t, width, head_dim, lut, steps, out, o, largest, check, rows
                )
                continue
            step = scales[first_scale + h * sh + t * st]
            for g in range(head_dim // 8):
                v = load_u64le(stream, q)
                bad |= (((v & even) + add) | (((v >> uw) & even) + add)) & carry
                dequantize8(stream, q, width, center, step, out, o + 8 * g)
                q += width
    return bad


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_transformed(
    stream, k, width, head_dim, lut, steps, out_f32, out_bf16, largest, rows, angles
):
    """:func:`_emit_transformed_rows`, with a copy for each common head_dim."""
    if head_dim == 64:
        return _emit_transformed_rows(
            stream, k, width, 64, lut, steps, out_f32, out_bf16, largest, rows, angles
        )
    if head_dim == 128:
        return _emit_transformed_rows(
            stream, k, width, 128, lut, steps, out_f32, out_bf16, largest, rows, angles
        )
    if head_dim == 256:
        return _emit_transformed_rows(
            stream, k, width, 256, lut, steps, out_f32, out_bf16, largest, rows, angles
        )
    return _emit_transformed_rows(
        stream, k, width, head_dim, lut, steps, out_f32, out_bf16, largest, rows, angles
    )


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_transformed_rows(
    stream, k, width, head_dim, lut, steps, out_f32, out_bf16, largest, rows, angles
):
    """:func:`_emit_rows` through a float32 row that is transformed before it is stored
    (``angles``: the transform arguments of ``decode_streams`` and the stream's first row of
    angles, or -1): ``qkernels.store_transformed``'s arithmetic."""
    num_channels, num_tokens, scale_stride, token_map, token_off, out_base, out_token_stride = rows
    scales, first_scale, center = steps
    hadamard, cos, sin, first_angle = angles
    T = num_tokens[k]
    sh, st, per_channel = scale_stride[k, 0], scale_stride[k, 1], scale_stride[k, 2]
    inv_sqrt = np.float32(1.0 / np.sqrt(np.float64(head_dim)))
    check = _field_check(width, largest)
    even, add, carry = check
    uw = np.uint64(width)
    row = np.empty(head_dim, dtype=np.float32)
    rotate = first_angle >= 0
    bad = np.uint64(0)
    for h in range(num_channels[k] // head_dim):
        for t in range(T):
            o = out_base[k] + (h * out_token_stride + token_map[token_off[k] + t]) * head_dim
            q = _whole_row_at((h * T + t) * head_dim, width, head_dim, stream.shape[0])
            if per_channel or q < 0:
                bad |= _emit_row_slowly(
                    stream, k, h, t, width, head_dim, lut, steps, row, 0, largest, check, rows
                )
            else:
                step = scales[first_scale + h * sh + t * st]
                for g in range(head_dim // 8):
                    v = load_u64le(stream, q)
                    bad |= (((v & even) + add) | (((v >> uw) & even) + add)) & carry
                    dequantize8(stream, q, width, center, step, row, 8 * g)
                    q += width
            if hadamard and not hadamard_vector(row, head_dim, inv_sqrt):
                hadamard_row(row, head_dim, inv_sqrt)
            store_row(row, cos, sin, first_angle + t, rotate, head_dim, out_f32, out_bf16, o)
    return bad
