"""The packed form of a cachegen level: its symbols stored at a fixed width (numba kernels).

A level's quantized symbols can be entropy-coded (``rans.py``, the smallest) or bit-packed
(a few times larger, decoded at memory speed). Both hold the same symbols and scales, so
both decode to the same KV, bit for bit. A packed *stream* holds the symbols of one
(layer, K/V, segment) of a frame in the order ``[heads, tokens, head_dim]``, each in
``width`` bits, the fewest that hold the layer's largest symbol (``2 * max_level``): symbol
``i`` is bits ``[i * width, (i + 1) * width)`` of a little-endian bit string (bit ``j`` is bit
``j % 8`` of byte ``j // 8``), the last byte padded with zero bits. Eight symbols fill
``width`` bytes, so the decoder reads a row of a head's channels eight symbols per load.

Kernels release the GIL; ``cachegen.codec.parallel`` spreads streams over threads. The
layout is also documented in ``docs/bitstream.md``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from cachegen.codec.bitstream import CODED, FORMS, PACKED
from cachegen.codec.errors import CodecError
from cachegen.codec.qkernels import f32_to_bf16, hadamard_row, store_row
from cachegen.codec.quant import max_level

PACKED_TAG = 1 << 15  # the store's u16 level slot: this bit marks a packed record


def symbol_width(bins: int) -> int:
    """Bits per packed symbol of a layer with ``bins`` bins (symbols ``0 .. 2 * max_level``)."""
    return (2 * max_level(bins)).bit_length()


def packed_bytes(symbols: np.ndarray | int, width: np.ndarray | int) -> np.ndarray | int:
    """Bytes of a packed stream of ``symbols`` symbols of ``width`` bits."""
    return (symbols * width + 7) // 8


def record_tag(level: int, form: str = CODED) -> int:
    """A level-like u16 naming ``level`` in ``form``, for stores that key records by
    ``(key, level)``: the level itself for the coded form, the level with bit 15 set for the
    packed form (so tagged levels must be below 32768)."""
    if form not in FORMS:
        raise CodecError(f"unknown form {form!r}; use {' or '.join(FORMS)}")
    if not 0 <= level < PACKED_TAG:
        raise CodecError(f"level {level} has no record tag (tagged levels are 0..{PACKED_TAG - 1})")
    return level | PACKED_TAG if form == PACKED else level


def split_record_tag(tag: int) -> tuple[int, str]:
    """``(level, form)`` of a tag from :func:`record_tag`."""
    return (tag & ~PACKED_TAG, PACKED) if tag & PACKED_TAG else (tag, CODED)


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
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]], wraparound=False)
        word = builder.load(builder.bitcast(ptr, ir.IntType(64).as_pointer()), align=1)
        if not np.little_endian:
            fn = cgutils.get_or_insert_function(
                builder.module,
                ir.FunctionType(ir.IntType(64), [ir.IntType(64)]),
                "llvm.bswap.i64",
            )
            word = builder.call(fn, [word])
        return word

    return types.uint64(array, index), codegen


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


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _stream_scales(k, num_channels, num_tokens, scale_stride, head_dim):
    """Scales of stream ``k``: one per token, per token and head, or per channel."""
    if scale_stride[k, 2]:
        return num_channels[k]
    if scale_stride[k, 0]:
        return num_channels[k] // head_dim * num_tokens[k]
    return num_tokens[k]


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
        bit = (first + d) * width
        b = bit >> 3
        x = np.uint64(stream[b])
        if b + 1 < stream.shape[0]:
            x |= np.uint64(stream[b + 1]) << np.uint64(8)
        s = np.int64((x >> np.uint64(bit & 7)) & mask)
        bad |= np.uint64(s > largest)
        out[o + d * spacing] = lut[lb + d * ls + s]
    return bad


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_streams(
    data,
    byte_off,
    widths,
    num_channels,
    num_tokens,
    scales,
    scale_off,
    scale_stride,
    center,
    head_dim,
    token_map,
    token_off,
    out_f32,
    out_bf16,
    out_base,
    out_token_stride,
    hadamard,
    cos,
    sin,
    angle_row,
    todo,
    status,
):
    """Unpack and dequantize streams ``todo``; stream ``k`` is ``data[byte_off[k]:byte_off[k+1]]``
    at ``widths[k]`` bits per symbol, its sizes already checked against the header.

    Dequantization and output placement are ``rans.decode_streams``'s (same arguments, same
    float32 arithmetic, same bfloat16 rounding), so both forms write the same bits. Each
    scale's ``2 ** width`` values are computed once into a table (per token, per token and
    head, or per channel) and symbols are looked up in it: the float arithmetic per element,
    not the memory traffic, bounds a direct dequantization. ``status[k]`` becomes 1 when a
    symbol is outside the stream's alphabet, else 0.

    A level's transforms are undone row by row while the row is in cache (the coded form does
    the same arithmetic in ``qkernels.store_transformed``): every row times the Hadamard
    matrix if ``hadamard``, then, if ``angle_row[k] >= 0``, turned by the rotary angles of rows
    ``angle_row[k] + t`` of ``cos`` / ``sin`` (token ``t`` of the stream), then stored. Rows of
    a transformed stream are the tokens of the frame in order (no token locality).
    """
    to_bf16 = out_bf16.shape[0] > 0
    size = 1
    for i in range(todo.shape[0]):
        size = max(
            size,
            _stream_scales(todo[i], num_channels, num_tokens, scale_stride, head_dim)
            << widths[todo[i]],
        )
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
        so = scale_off[k]
        ctr = np.float32(center[k])
        transformed = hadamard or angle_row[k] >= 0
        to_lut16 = to_bf16 and not transformed
        # a table of the values of every symbol under every scale of the stream
        for j in range(_stream_scales(k, num_channels, num_tokens, scale_stride, head_dim)):
            _fill_values(lut16, lut32, j * symbols, symbols, ctr, scales[so + j], to_lut16)
        largest = 2 * center[k]
        if transformed:
            angles = (hadamard, cos, sin, angle_row[k])
            bad = _emit_transformed(
                stream, k, width, head_dim, lut32, out_f32, out_bf16, largest, rows, angles
            )
        elif to_bf16:
            bad = _emit_stream(stream, k, width, head_dim, lut16, out_bf16, largest, rows)
        else:
            bad = _emit_stream(stream, k, width, head_dim, lut32, out_f32, largest, rows)
        status[k] = 1 if bad else 0


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_stream(stream, k, width, head_dim, lut, out, largest, rows):
    """:func:`_emit_rows`; LLVM unrolls a row of a head_dim it knows, so the common ones get
    their own copy."""
    if head_dim == 64:
        return _emit_rows(stream, k, width, 64, lut, out, largest, rows)
    if head_dim == 128:
        return _emit_rows(stream, k, width, 128, lut, out, largest, rows)
    if head_dim == 256:
        return _emit_rows(stream, k, width, 256, lut, out, largest, rows)
    return _emit_rows(stream, k, width, head_dim, lut, out, largest, rows)


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_rows(stream, k, width, head_dim, lut, out, largest, rows):
    """Every row of stream ``k`` (``rows``: the placement arguments of ``decode_streams``);
    non-zero if a symbol is above ``largest``."""
    num_channels, num_tokens, scale_stride, token_map, token_off, out_base, out_token_stride = rows
    symbols = 1 << width
    T = num_tokens[k]
    sh, st, sc = scale_stride[k, 0], scale_stride[k, 1], scale_stride[k, 2]
    check = _field_check(width, largest)
    bad = np.uint64(0)
    for h in range(num_channels[k] // head_dim):
        for t in range(T):
            o = out_base[k] + (h * out_token_stride + token_map[token_off[k] + t]) * head_dim
            lb = (h * sh + t * st + h * head_dim * sc) * symbols
            bad |= _emit_row(
                stream, (h * T + t) * head_dim, width, head_dim, lut, lb, sc * symbols, out, o, 1,
                largest, check,
            )  # fmt: skip
    return bad


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_transformed(stream, k, width, head_dim, lut, out_f32, out_bf16, largest, rows, angles):
    """:func:`_emit_transformed_rows`, with a copy for each common head_dim."""
    if head_dim == 64:
        return _emit_transformed_rows(
            stream, k, width, 64, lut, out_f32, out_bf16, largest, rows, angles
        )
    if head_dim == 128:
        return _emit_transformed_rows(
            stream, k, width, 128, lut, out_f32, out_bf16, largest, rows, angles
        )
    if head_dim == 256:
        return _emit_transformed_rows(
            stream, k, width, 256, lut, out_f32, out_bf16, largest, rows, angles
        )
    return _emit_transformed_rows(
        stream, k, width, head_dim, lut, out_f32, out_bf16, largest, rows, angles
    )


@numba.njit(nogil=True, cache=True, boundscheck=False, inline="always")
def _emit_transformed_rows(
    stream, k, width, head_dim, lut, out_f32, out_bf16, largest, rows, angles
):
    """:func:`_emit_rows` through a float32 row that is transformed before it is stored
    (``angles``: the transform arguments of ``decode_streams`` and the stream's first row of
    angles, or -1): ``qkernels.store_transformed``'s arithmetic."""
    num_channels, num_tokens, scale_stride, token_map, token_off, out_base, out_token_stride = rows
    hadamard, cos, sin, first_angle = angles
    inv_sqrt = np.float32(1.0 / np.sqrt(np.float64(head_dim)))
    symbols = 1 << width
    T = num_tokens[k]
    sh, st, sc = scale_stride[k, 0], scale_stride[k, 1], scale_stride[k, 2]
    check = _field_check(width, largest)
    row = np.empty(head_dim, dtype=np.float32)
    bad = np.uint64(0)
    for h in range(num_channels[k] // head_dim):
        for t in range(T):
            o = out_base[k] + (h * out_token_stride + token_map[token_off[k] + t]) * head_dim
            lb = (h * sh + t * st + h * head_dim * sc) * symbols
            bad |= _emit_row(
                stream, (h * T + t) * head_dim, width, head_dim, lut, lb, sc * symbols, row, 0, 1,
                largest, check,
            )  # fmt: skip
            if hadamard:
                hadamard_row(row, head_dim, inv_sqrt)
            rotate = first_angle >= 0
            store_row(row, cos, sin, first_angle + t, rotate, head_dim, out_f32, out_bf16, o)
    return bad
