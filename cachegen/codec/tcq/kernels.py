"""Numba kernels of the ``tcq`` codec (:mod:`cachegen.codec.tcq.codec`).

The encoder's :func:`quantize_coefficients` rounds each component's coefficients around its
offset, and :func:`choose_tables` picks each component's table for a frame. A frame
decodes in three passes, each over all its (layer, K/V) streams:

1. :func:`decode_coefficients` (codec threads): each stream's rANS symbols, centred on their
   component's radius, into one row per token of a ``[streams, tokens, width]`` array of
   float32, int16 or bfloat16 bits (small integers, exact in all three; columns past the
   stream's kept components are zero), so that
2. one batched product with every stream's synthesis matrix (the kept components' rows
   scaled by their steps, padded with zero rows to ``width``) is a single dense GEMM: torch's
   BLAS (vectorized and register-blocked, far faster than a numba loop; in bfloat16 on CPUs
   with bfloat16 matrix instructions, where it is several times faster), or on other CPUs
   with AVX2 the int16 kernel of :mod:`cachegen.codec.tcq.int_synthesis`;
3. :func:`write_rows` (codec threads) adds the channel means in float32, turns keys by their
   rotary angles and writes bfloat16 bits (or float32) into the output's ``[heads, tokens,
   head_dim]`` layout.

The rANS layout is :mod:`cachegen.codec.coding.rans`'s (``LANES`` interleaved states, symbol order
channel group, token, lane); corrupt streams are reported in ``status`` exactly as its
``decode_streams`` does.
"""

from __future__ import annotations

import numba
import numpy as np

from cachegen.codec.cachegen.kernels import (
    as_f32,
    prefetch,
    store_row,
    store_value,
)
from cachegen.codec.coding.rans import (
    LANES,
    PROB_BITS,
    PROB_SCALE,
    RANS_L,
    STATE_WORDS,
    read_states,
)

# The decode kernels index with unsigned integers: numba then leaves out the wraparound of
# negative indices, and the lane group's values fit in registers.
_U = np.uint64
_U_L = _U(RANS_L)
_U_1 = _U(1)
_U_MASK = _U(PROB_SCALE - 1)
_U_PB = _U(PROB_BITS)
_U_16 = _U(16)
_U_FFFF = _U(0xFFFF)
_U_SCALE = _U(PROB_SCALE)
_U_LANES = _U(LANES)
_TABLE_LINES = _U(PROB_SCALE // 64)  # 64-byte cache lines of one slot table


@numba.njit(inline="always")
def _step(x, slots, cums, slot_flat, fc_flat, words, p, last):
    """One rANS decode step of a state ``x`` whose table starts at ``slots`` in ``slot_flat``
    and at ``cums`` in ``fc_flat`` (:func:`cachegen.codec.coding.rans._decode_step`'s arithmetic):
    (new state, new read position, symbol). Not that function itself, nor a helper sharing its
    update: both measured slower here (2D tables and a signed read position; a returned flag
    for the renormalisation), docs/codec.md "Decode speed"."""
    slot = x & _U_MASK
    s = _U(slot_flat[slots + slot])
    fc = _U(fc_flat[cums + s])
    x = (fc >> _U_16) * (x >> _U_PB) + slot - (fc & _U_FFFF)
    w = _U(words[min(p, last)])
    if x < _U_L:
        x = (x << _U_16) | w
        p += _U_1
    return x, p, np.int64(s)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_coefficients(
    words,
    word_off,
    kept,
    table_row,
    radius,
    radius_off,
    slot_sym,
    freq_cum,
    out,
    T,
    width,
    todo,
    status,
):
    """rANS-decode streams ``todo`` into ``out``, flat [streams, T, width] (float32, bfloat16
    bits if uint16, or int16): component ``c < kept[k]`` of stream ``k`` (table row
    ``table_row[j]``, ``j = radius_off[k] + c``) and token ``t`` into ``out[k, t, c] = s -
    radius[j]`` (int64 radii), 0 past ``kept[k]``. ``status[k]``: 0 decoded cleanly, 1 corrupt
    (wrong word count or final states; a stream without components has no words)."""
    states = np.empty(LANES, dtype=np.uint64)
    slot_flat, fc_flat = slot_sym.reshape(-1), freq_cum.reshape(-1)
    fc_width, W, UT = _U(freq_cum.shape[1]), _U(width), _U(T)
    for i in range(todo.shape[0]):
        k = _U(todo[i])
        C = _U(kept[k])
        for t in range(T):  # the columns past the kept components
            out[(k * UT + _U(t)) * W + C : (k * UT + _U(t) + _U_1) * W] = 0
        w0, end = _U(word_off[k]), _U(word_off[k + _U_1])
        if C == 0 or T == 0:
            status[k] = 0 if end == w0 else 1
            continue
        if end - w0 < _U(STATE_WORDS):
            status[k] = 1
            continue
        p = _U(read_states(words, np.int64(w0), states))
        for g in range(0, C, LANES):
            ro, at = _U(radius_off[k]) + _U(g), k * UT * W + _U(g)  # component g of token 0
            if C - _U(g) >= _U_LANES:
                ahead = _U(g) + _U(2 * LANES) <= C  # another full group follows
                p = _decode_group(
                    states,
                    words,
                    p,
                    end - _U_1,
                    ro,
                    at,
                    ahead,
                    T,
                    W,
                    table_row,
                    fc_width,
                    slot_flat,
                    fc_flat,
                    radius,
                    out,
                )
            else:
                p = _decode_tail(
                    states,
                    words,
                    p,
                    end - _U_1,
                    ro,
                    at,
                    C - _U(g),
                    T,
                    W,
                    table_row,
                    fc_width,
                    slot_flat,
                    fc_flat,
                    radius,
                    out,
                )
        ok = p == end
        for lane in range(LANES):
            if states[lane] != _U_L:
                ok = False
        status[k] = 0 if ok else 1


@numba.njit(inline="always")
def _prefetch_next(t, ro, table_row, fc_width, slot_flat, fc_flat):
    """Token ``t``'s share of fetching the next lane group's tables (components ``ro + LANES``
    on) into cache: one cache line per token (:func:`_prefetch_lines` in all), slot tables
    first."""
    slot_lines = _U_LANES * _TABLE_LINES
    if t < slot_lines:
        row = _U(table_row[ro + _U_LANES + t // _TABLE_LINES])
        prefetch(slot_flat, row * _U_SCALE + (t % _TABLE_LINES) * _U(64))
    else:
        fc_lines = (fc_width * _U(4) + _U(63)) // _U(64)
        u = t - slot_lines
        row = _U(table_row[ro + _U_LANES + u // fc_lines])
        prefetch(fc_flat, row * fc_width + (u % fc_lines) * _U(16))


@numba.njit(inline="always")
def _prefetch_lines(fc_width):
    """Cache lines of a lane group's tables."""
    return _U_LANES * (_TABLE_LINES + (fc_width * _U(4) + _U(63)) // _U(64))


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_group(
    states,
    words,
    p,
    last,
    ro,
    at,
    ahead,
    T,
    width,
    table_row,
    fc_width,
    slot_flat,
    fc_flat,
    radius,
    out,
):
    """``LANES`` components (kept components ``ro`` on, coefficients from ``out[at]``, rows
    ``width`` apart), every token, each lane's state in a register; prefetches the next
    group's tables if ``ahead`` (short streams stall on fetching them on demand). Returns the
    next word's position."""
    x0, x1, x2, x3 = states[0], states[1], states[2], states[3]
    x4, x5, x6, x7 = states[4], states[5], states[6], states[7]
    r0, r1, r2, r3 = radius[ro], radius[ro + _U(1)], radius[ro + _U(2)], radius[ro + _U(3)]
    r4, r5, r6, r7 = radius[ro + _U(4)], radius[ro + _U(5)], radius[ro + _U(6)], radius[ro + _U(7)]
    t0, t1 = _U(table_row[ro]), _U(table_row[ro + _U(1)])
    t2, t3 = _U(table_row[ro + _U(2)]), _U(table_row[ro + _U(3)])
    t4, t5 = _U(table_row[ro + _U(4)]), _U(table_row[ro + _U(5)])
    t6, t7 = _U(table_row[ro + _U(6)]), _U(table_row[ro + _U(7)])
    s0, s1, s2, s3 = t0 * _U_SCALE, t1 * _U_SCALE, t2 * _U_SCALE, t3 * _U_SCALE
    s4, s5, s6, s7 = t4 * _U_SCALE, t5 * _U_SCALE, t6 * _U_SCALE, t7 * _U_SCALE
    c0, c1, c2, c3 = t0 * fc_width, t1 * fc_width, t2 * fc_width, t3 * fc_width
    c4, c5, c6, c7 = t4 * fc_width, t5 * fc_width, t6 * fc_width, t7 * fc_width
    lines = _prefetch_lines(fc_width) if ahead else _U(0)
    for t in range(T):
        if _U(t) < lines:
            _prefetch_next(_U(t), ro, table_row, fc_width, slot_flat, fc_flat)
        o = at + _U(t) * width
        x0, p, y = _step(x0, s0, c0, slot_flat, fc_flat, words, p, last)
        store_value(out, o, y - r0)
        x1, p, y = _step(x1, s1, c1, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(1), y - r1)
        x2, p, y = _step(x2, s2, c2, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(2), y - r2)
        x3, p, y = _step(x3, s3, c3, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(3), y - r3)
        x4, p, y = _step(x4, s4, c4, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(4), y - r4)
        x5, p, y = _step(x5, s5, c5, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(5), y - r5)
        x6, p, y = _step(x6, s6, c6, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(6), y - r6)
        x7, p, y = _step(x7, s7, c7, slot_flat, fc_flat, words, p, last)
        store_value(out, o + _U(7), y - r7)
    states[0], states[1], states[2], states[3] = x0, x1, x2, x3
    states[4], states[5], states[6], states[7] = x4, x5, x6, x7
    return p


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_tail(
    states,
    words,
    p,
    last,
    ro,
    at,
    lanes,
    T,
    width,
    table_row,
    fc_width,
    slot_flat,
    fc_flat,
    radius,
    out,
):
    """The last ``lanes`` (< LANES) components of a stream, like :func:`_decode_group`
    without the registers; returns the next word's position."""
    for t in range(T):
        for lane in range(lanes):
            j = ro + _U(lane)
            row = _U(table_row[j])
            x, p, y = _step(
                states[lane], row * _U_SCALE, row * fc_width, slot_flat, fc_flat, words, p, last
            )
            states[lane] = x
            store_value(out, at + _U(t) * width + _U(lane), y - radius[j])
    return p


@numba.njit(nogil=True, cache=True, boundscheck=False)
def write_rows(
    rows, mean, first_angle, cos, sin, heads, head_dim, out16, out32, base, tokens, todo
):
    """Streams ``todo`` of ``rows`` [streams, m, heads * head_dim] (float32, or bfloat16 bits
    if uint16) plus their channel means ``mean`` [streams, heads * head_dim], keys
    turned by the NeoX rotary angles of rows ``first_angle[k] + t`` of ``cos``/``sin`` (as
    ``rotary.rotary_cos_sin`` makes them; ``first_angle[k]`` -1: not turned), written as
    bfloat16 bits into ``out16`` when it is non-empty, else as float32 into ``out32``: head
    ``h`` of token ``t`` of stream ``k`` at ``base[k] + (h * tokens + t) * head_dim``
    (``qkernels.store_row``'s arithmetic, in vector registers)."""
    _, m, _ = rows.shape
    rows_flat = rows.reshape(-1)
    row = np.empty(head_dim, dtype=np.float32)
    for i in range(todo.shape[0]):
        k = todo[i]
        rotate = first_angle[k] >= 0
        for h in range(heads):
            for t in range(m):
                at = (k * m + t) * heads * head_dim + h * head_dim
                for d in range(head_dim):
                    row[d] = as_f32(rows_flat[at + d]) + mean[k, h * head_dim + d]
                o = base[k] + (h * tokens + t) * head_dim
                store_row(row, cos, sin, first_angle[k] + t, rotate, head_dim, out32, out16, o)


@numba.njit(nogil=True, cache=True)
def quantize_coefficients(y, radius, centred, offset_units, sym, offset):
    """Each kept component's symbols (into ``sym`` [components, tokens], uint8: the rounded
    coefficient clipped to ``[-r, r]``, plus ``r``) of its coefficients ``y`` [components,
    tokens] (float32, in steps), and where ``centred`` its offset (into ``offset``, int8, in
    1 / ``offset_units`` steps: the lower median of the coefficients, clipped to +-127), which
    ``y`` then has subtracted in place. The median of the rounded values is the rounded median
    (rounding keeps order), so one histogram over +-128 finds it."""
    C, T = y.shape
    units = np.float32(offset_units)
    hist = np.zeros(257, dtype=np.int64)
    for c in range(C):
        shift = np.float32(0.0)
        offset[c] = 0
        if centred and T > 0:
            hist[:] = 0
            for t in range(T):
                v = min(max(np.rint(y[c, t] * units), np.float32(-128.0)), np.float32(128.0))
                hist[np.int64(v) + 128] += 1
            seen, middle, at = 0, (T - 1) // 2, 0
            while seen + hist[at] <= middle:
                seen += hist[at]
                at += 1
            off = min(max(at - 128, -127), 127)
            offset[c] = off
            shift = np.float32(off) / units
        r = np.float32(radius[c])
        for t in range(T):
            v = y[c, t] - shift
            y[c, t] = v
            sym[c, t] = np.uint8(min(max(np.rint(v), -r), r) + r)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def choose_tables(sym, radius, rows, code_bits, family_bits, family_start, choice):
    """Into ``choice`` (uint8, one per component of ``sym`` [components, tokens]): 0 where
    the component's calibrated table (row ``rows[c]`` of ``code_bits``, each row the code
    lengths of its table's symbols) codes its symbols in the fewest bits, else ``1 + j`` for
    the first cheapest family table ``j`` of its radius (``family_bits`` [symbols, tables]:
    symbol ``v`` of radius ``r`` at row ``family_start[r] + v``; -1: the radius has none).
    Costs sum over the symbols that occur only (a frame's component takes a few of its
    alphabet's values), in ascending order."""
    C, T = sym.shape
    width = code_bits.shape[1]
    # four histograms, so that runs of one symbol do not wait on each other's increments
    hist = np.zeros((4, width), dtype=np.int64)
    seen = np.empty(width, dtype=np.int64)
    counts = np.empty(width, dtype=np.float64)
    cost = np.empty(family_bits.shape[1], dtype=np.float64)
    for c in range(C):
        lo, hi = width, 0
        for t in range(T):
            v = np.int64(sym[c, t])
            hist[t & 3, v] += 1
            lo, hi = min(lo, v), max(hi, v)
        n = 0
        for v in range(lo, hi + 1):
            count = hist[0, v] + hist[1, v] + hist[2, v] + hist[3, v]
            if count:
                seen[n], counts[n] = v, count
                n += 1
                hist[0, v] = hist[1, v] = hist[2, v] = hist[3, v] = 0
        best, best_cost = 0, 0.0
        for i in range(n):
            best_cost += counts[i] * code_bits[rows[c], seen[i]]
        first = family_start[radius[c]]
        if first < 0:
            choice[c] = 0
            continue
        cost[:] = 0.0
        for i in range(n):
            at, count = first + seen[i], counts[i]
            for j in range(cost.shape[0]):
                cost[j] += count * family_bits[at, j]
        for j in range(cost.shape[0]):
            if cost[j] < best_cost:
                best, best_cost = 1 + j, cost[j]
        choice[c] = best


@numba.njit(nogil=True, cache=True)
def refined_rows_of(mask, kept):
    """The refined rows of a frame in stream order, from its mask [layers, tokens] (bool) and
    its streams' kept component counts ``kept`` [2 * layers]: (stream, coded token) of each
    row of the streams with kept components (int64 [n] each), and where each stream's rows
    start ([streams + 1])."""
    layers, tokens = mask.shape
    per_layer = np.zeros(layers, dtype=np.int64)
    for i in range(layers):
        for t in range(tokens):
            per_layer[i] += mask[i, t]
    n = 0
    for s in range(2 * layers):
        n += per_layer[s // 2] if kept[s] > 0 else 0
    stream = np.empty(n, dtype=np.int64)
    token = np.empty(n, dtype=np.int64)
    start = np.zeros(2 * layers + 1, dtype=np.int64)
    j = 0
    for s in range(2 * layers):
        if kept[s] > 0:
            for t in range(tokens):
                if mask[s // 2, t]:
                    stream[j], token[j] = s, t
                    j += 1
        start[s + 1] = j
    return stream, token, start


@numba.njit(nogil=True, cache=True)
def spread_rows(symbols, stream, kept, width):
    """``symbols`` (int16, each row's kept components one row after another) as rows [n,
    width], zero past each row's stream's ``kept`` components."""
    rows = np.zeros((stream.shape[0], width), dtype=np.int16)
    j = 0
    for i in range(stream.shape[0]):
        for c in range(kept[stream[i]]):
            rows[i, c] = symbols[j]
            j += 1
    return rows
