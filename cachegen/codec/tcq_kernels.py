"""Numba kernels of the ``tcq`` codec (:mod:`cachegen.codec.tcq`).

The encoder's :func:`choose_tables` picks each component's table for a frame. A frame
decodes in three passes, each over all its (layer, K/V) streams:

1. :func:`decode_coefficients` (codec threads): each stream's rANS symbols, centred on their
   component's radius, into one row per token of a ``[streams, tokens, width]`` array of
   float32, int16 or bfloat16 bits (small integers, exact in all three; columns past the
   stream's kept components are zero), so that
2. one batched product with every stream's synthesis matrix (the kept components' rows
   scaled by their steps, padded with zero rows to ``width``) is a single dense GEMM: torch's
   BLAS (vectorized and register-blocked, far faster than a numba loop; in bfloat16 on CPUs
   with bfloat16 matrix instructions, where it is several times faster), or on other CPUs
   with AVX2 the int16 kernel of :mod:`cachegen.codec.int_synthesis`;
3. :func:`write_rows` (codec threads) adds the channel means in float32, turns keys by their
   rotary angles and writes bfloat16 bits (or float32) into the output's ``[heads, tokens,
   head_dim]`` layout.

The rANS layout is :mod:`cachegen.codec.rans`'s (``LANES`` interleaved states, symbol order
channel group, token, lane); corrupt streams are reported in ``status`` exactly as its
``decode_streams`` does.
"""

from __future__ import annotations

import numba
import numpy as np

from cachegen.codec.qkernels import (
    as_f32,
    prefetch,
    store_row,
    store_value,
)
from cachegen.codec.rans import LANES, PROB_SCALE, RANS_L, STATE_WORDS, read_states
from cachegen.codec.rans import _decode_step as decode_step  # the coder's own step

_U_L = np.uint64(RANS_L)


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
    """rANS-decode streams ``todo`` into ``out``, flat [streams, T, width] (float32, or
    bfloat16 bits if uint16, or int16). Stream ``k`` has ``kept[k]`` components, component ``c``
    coded with table row ``table_row[radius_off[k] + c]``; its symbol ``s`` of component
    ``c`` and token ``t`` becomes ``out[k, t, c] = s - radius[radius_off[k] + c]``, and
    ``out[k, t, c]`` is 0 for ``c >= kept[k]``. A stream without components has no words.
    ``status[k]``: 0 when the stream decoded cleanly, 1 when it is corrupt (wrong word count
    or final states)."""
    states = np.empty(LANES, dtype=np.uint64)
    for i in range(todo.shape[0]):
        k = todo[i]
        C = kept[k]
        for t in range(T):  # the columns past the kept components
            out[(k * T + t) * width + C : (k * T + t + 1) * width] = 0
        w0 = word_off[k]
        end = word_off[k + 1]
        if C == 0 or T == 0:
            status[k] = 0 if end == w0 else 1
            continue
        if end - w0 < STATE_WORDS:
            status[k] = 1
            continue
        p = read_states(words, w0, states)
        last = end - 1
        for g in range(0, C, LANES):
            ro, at = radius_off[k] + g, k * T * width + g  # at: component g of token 0
            if C - g >= LANES:
                p = _decode_group(
                    states,
                    words,
                    p,
                    last,
                    ro,
                    at,
                    g + 2 * LANES <= C,  # another full group follows: prefetch its tables
                    T,
                    width,
                    table_row,
                    radius,
                    slot_sym,
                    freq_cum,
                    out,
                )
            else:
                p = _decode_tail(
                    states,
                    words,
                    p,
                    last,
                    ro,
                    at,
                    C - g,
                    T,
                    width,
                    table_row,
                    radius,
                    slot_sym,
                    freq_cum,
                    out,
                )
        ok = p == end
        for lane in range(LANES):
            if states[lane] != _U_L:
                ok = False
        status[k] = 0 if ok else 1


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_group(
    states, words, p, last, ro, at, ahead, T, width, table_row, radius, slot_sym, freq_cum, out
):
    """``LANES`` components (kept components ``ro`` on, coefficients from ``out[at]``, rows
    ``width`` apart), every token, each lane's state in a register; prefetches the next
    group's tables if ``ahead``. Returns the next word's position."""
    slot_flat = slot_sym.reshape(-1)
    fc_flat = freq_cum.reshape(-1)
    fc_width = freq_cum.shape[1]
    table_lines = PROB_SCALE // 64  # 64-byte cache lines of one slot table
    slot_lines = LANES * table_lines  # ... of a group's slot tables
    fc_table_lines = (fc_width * 4 + 63) // 64
    x0, x1, x2, x3 = states[0], states[1], states[2], states[3]
    x4, x5, x6, x7 = states[4], states[5], states[6], states[7]
    r0, r1, r2, r3 = radius[ro], radius[ro + 1], radius[ro + 2], radius[ro + 3]
    r4, r5, r6, r7 = radius[ro + 4], radius[ro + 5], radius[ro + 6], radius[ro + 7]
    t0, t1 = table_row[ro], table_row[ro + 1]
    t2, t3 = table_row[ro + 2], table_row[ro + 3]
    t4, t5 = table_row[ro + 4], table_row[ro + 5]
    t6, t7 = table_row[ro + 6], table_row[ro + 7]
    # prefetch the next group's tables while this one decodes (short streams
    # stall on fetching them on demand)
    for t in range(T):
        if ahead:
            if t < slot_lines:
                row = table_row[ro + LANES + t // table_lines]
                prefetch(slot_flat, row * PROB_SCALE + (t % table_lines) * 64)
            elif t < slot_lines + LANES * fc_table_lines:
                u = t - slot_lines
                row = table_row[ro + LANES + u // fc_table_lines]
                prefetch(fc_flat, row * fc_width + (u % fc_table_lines) * 16)
        row_at = at + t * width
        x0, p, y = decode_step(x0, t0, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at, np.float32(y) - r0)
        x1, p, y = decode_step(x1, t1, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 1, np.float32(y) - r1)
        x2, p, y = decode_step(x2, t2, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 2, np.float32(y) - r2)
        x3, p, y = decode_step(x3, t3, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 3, np.float32(y) - r3)
        x4, p, y = decode_step(x4, t4, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 4, np.float32(y) - r4)
        x5, p, y = decode_step(x5, t5, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 5, np.float32(y) - r5)
        x6, p, y = decode_step(x6, t6, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 6, np.float32(y) - r6)
        x7, p, y = decode_step(x7, t7, slot_sym, freq_cum, words, p, last)
        store_value(out, row_at + 7, np.float32(y) - r7)
    states[0], states[1], states[2], states[3] = x0, x1, x2, x3
    states[4], states[5], states[6], states[7] = x4, x5, x6, x7
    return p


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_tail(
    states, words, p, last, ro, at, lanes, T, width, table_row, radius, slot_sym, freq_cum, out
):
    """The last ``lanes`` (< LANES) components of a stream, like :func:`_decode_group`
    without the registers; returns the next word's position."""
    for t in range(T):
        for lane in range(lanes):
            x, p, y = decode_step(
                states[lane], table_row[ro + lane], slot_sym, freq_cum, words, p, last
            )
            states[lane] = x
            store_value(out, at + t * width + lane, np.float32(y) - radius[ro + lane])
    return p


@numba.njit(nogil=True, cache=True, boundscheck=False)
def write_rows(
    rows, mean, first_angle, cos, sin, heads, head_dim, out16, out32, base, tokens, todo
):
    """Streams ``todo`` of ``rows`` [streams, m, heads * head_dim] (float32, or bfloat16 bits
    if uint16) plus their channel means ``mean`` [streams, heads * head_dim], keys
    turned by the NeoX rotary angles of rows ``first_angle[k] + t`` of ``cos``/``sin`` (as
    ``quant.rotary_cos_sin`` makes them; ``first_angle[k]`` -1: not turned), written as
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


@numba.njit(nogil=True, cache=True, boundscheck=False)
def choose_tables(sym, radius, rows, family_row, family_size, code_bits, choice):
    """Into ``choice`` (uint8, one per component of ``sym`` [components, tokens]): 0 where
    the component's calibrated table (row ``rows[c]`` of ``code_bits``, each row the code
    lengths of its table's symbols) codes its symbols in the fewest bits, else ``1 + j`` for
    the first cheapest of the ``family_size`` family tables of its radius (rows from
    ``family_row[radius[c]]``)."""
    C, T = sym.shape
    width = code_bits.shape[1]
    counts = np.zeros(width, dtype=np.float64)
    for c in range(C):
        n = 2 * radius[c] + 1
        counts[:n] = 0.0
        for t in range(T):
            counts[sym[c, t]] += 1.0
        own = 0.0
        for v in range(n):
            own += counts[v] * code_bits[rows[c], v]
        best, best_cost = 0, own
        first = family_row[radius[c]]
        for j in range(family_size if first >= 0 else 0):
            cost = 0.0
            for v in range(n):
                cost += counts[v] * code_bits[first + j, v]
            if cost < best_cost:
                best, best_cost = 1 + j, cost
        choice[c] = best
