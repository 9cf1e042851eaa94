"""Interleaved rANS entropy coder with static per-channel tables (numba kernels).

The hot path of the CacheGen codec. Symbols are small integers (a quantized KV element plus
an offset) and every channel (one position in ``num_kv_heads * head_dim``) of one layer and
K/V has its own probability table, taken from the model's calibrated profile. A *stream*
codes a ``[channels, tokens]`` block of symbols:

* ``LANES`` rANS states run side by side, lane ``i`` coding channels ``i, i + LANES, ...``;
  the symbol order is channel group, then token, then lane. Independent lanes give the CPU
  instruction-level parallelism that one rANS state (a serial dependency chain) cannot.
* 32-bit states in ``[2**16, 2**32)``, 16-bit renormalisation, ``PROB_BITS``-bit
  frequencies: at most one 16-bit word moves per symbol, so renormalising is one step.
  10-bit frequencies keep a channel's decode table at 1 KB, so a lane group's tables stay
  in L1; 12 bits halved decode speed for 0.3% less output on SmolLM2.
* the coded stream is a little-endian ``uint16`` array: the ``LANES`` final encoder states
  (low word first) followed by the renormalisation words in decoding order.

Decoding verifies that it consumed exactly the stream's words and that every lane ends in
the encoder's initial state, so corrupt input is detected without trusting any length in
it; reads past the end are clamped, never performed.

Kernels release the GIL (``nogil``); ``cachegen.codec.coding.parallel`` spreads streams over
threads. The same layout is documented in ``docs/bitstream.md``.
"""

from __future__ import annotations

import numba
import numpy as np

from cachegen.codec.cachegen.kernels import f32_to_bf16, prefetch

PROB_BITS = 10
PROB_SCALE = 1 << PROB_BITS
RANS_L = 1 << 16
LANES = 8
STATE_WORDS = 2 * LANES  # words holding the final encoder states at the start of a stream
MAX_ALPHABET = 255

# Typed constants for the kernels: numba promotes mixed signed/unsigned integer arithmetic
# to float64, so all state arithmetic is done in uint64.
_U_PB = np.uint64(PROB_BITS)
_U_MASK = np.uint64(PROB_SCALE - 1)
_U_L = np.uint64(RANS_L)
_U_16 = np.uint64(16)
_U_FFFF = np.uint64(0xFFFF)
_U_XMAX_UNIT = np.uint64((RANS_L >> PROB_BITS) << 16)


# ---- probability tables -------------------------------------------------------------------


def quantize_frequencies(counts: np.ndarray, alphabet: np.ndarray) -> np.ndarray:
    """Integer frequencies summing to ``PROB_SCALE`` from symbol counts, deterministically.

    ``counts`` is ``[tables, max_alphabet]`` (int64), ``alphabet[i]`` the number of symbols
    table ``i`` must be able to code. Every in-alphabet symbol gets at least one slot (so
    any symbol stays codable); the rest of the scale is shared in proportion to the counts,
    with leftover slots going to the largest fractional parts (ties by symbol index).
    Only integer and IEEE float64 arithmetic: the same counts give the same table on every
    machine.
    """
    counts = np.asarray(counts, dtype=np.int64)
    num_tables, width = counts.shape
    alphabet = np.asarray(alphabet, dtype=np.int64)
    if np.any(alphabet < 2) or np.any(alphabet > width) or np.any(alphabet > MAX_ALPHABET):
        raise ValueError("alphabet sizes must be in [2, max_alphabet]")
    inside = np.arange(width)[None, :] < alphabet[:, None]
    counts = np.where(inside, counts, 0)
    totals = counts.sum(axis=1)
    # Tables never seen in calibration fall back to uniform.
    counts = np.where((totals == 0)[:, None] & inside, 1, counts)
    totals = counts.sum(axis=1)
    spare = PROB_SCALE - alphabet
    exact = counts.astype(np.float64) * (spare / totals.astype(np.float64))[:, None]
    base = np.floor(exact).astype(np.int64)
    left = spare - base.sum(axis=1)
    frac = np.where(inside, exact - base, -1.0)
    # rank of each symbol by (fraction descending, index ascending)
    order = np.argsort(-frac, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(width)[None, :].repeat(num_tables, axis=0), axis=1)
    extra = (rank < left[:, None]) & inside
    freq = np.where(inside, base + 1 + extra, 0)
    assert np.all(freq.sum(axis=1) == PROB_SCALE)
    return freq.astype(np.uint16)


def cumulative(freq: np.ndarray) -> np.ndarray:
    """Start of each symbol's slot range (``uint16``; the last range ends at ``PROB_SCALE``)."""
    cum = np.zeros_like(freq, dtype=np.int64)
    cum[:, 1:] = np.cumsum(freq[:, :-1].astype(np.int64), axis=1)
    return cum.astype(np.uint16)


def pack_freq_cum(freq: np.ndarray) -> np.ndarray:
    """``freq << 16 | cum`` as uint32: one load per decoded symbol instead of two."""
    return (freq.astype(np.uint32) << 16) | cumulative(freq).astype(np.uint32)


def slot_table(freq: np.ndarray) -> np.ndarray:
    """``[tables, PROB_SCALE]`` uint8: the symbol owning each slot (decoder lookup)."""
    num_tables, width = freq.shape
    slots = np.repeat(
        np.tile(np.arange(width, dtype=np.uint8), num_tables), freq.reshape(-1).astype(np.int64)
    )
    return slots.reshape(num_tables, PROB_SCALE)


def code_length_bits(freq: np.ndarray, table_ids: np.ndarray, symbols: np.ndarray) -> float:
    """Ideal code length (bits) of ``symbols[c, t]`` under table ``table_ids[c]``."""
    p = freq[table_ids[:, None], symbols.astype(np.int64)].astype(np.float64) / PROB_SCALE
    return float(-np.log2(p).sum())


# ---- kernels ------------------------------------------------------------------------------


# 1/f for every frequency: x // f as a float multiply plus a one-step fix-up is several times
# faster than 64-bit integer division (x < 2**32, so the float product is off by at most one).
_RCP = np.array([0.0] + [1.0 / f for f in range(1, PROB_SCALE + 1)])


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _encode_step(x, s, tid, freq_cum, out, p):
    """One rANS encode step (renormalise, then push ``s``): (new state, new write position)."""
    fc = np.uint64(freq_cum[tid, s])
    f = fc >> _U_16
    if x >= _U_XMAX_UNIT * f:
        p -= 1
        out[p] = x & _U_FFFF
        x >>= _U_16
    q = np.uint64(np.float64(x) * _RCP[f])
    r = x - q * f
    if r >= f:
        q += np.uint64(1)
        r -= f
    return (q << _U_PB) + r + (fc & _U_FFFF), p


@numba.njit(inline="always")
def eight(a):
    """The first ``LANES`` (eight) elements of ``a``, as scalars: a lane group's states kept in
    registers (about twice as fast as an array of states)."""
    return a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def encode_layers(sym, table_base, freq_cum, out, out_off, todo, out_start):
    """Encode layers ``todo`` of the symbols ``sym`` [L, H, n, D] (uint8), one stream per layer.

    Channel ``c = h * D + d`` of layer ``l`` uses table row ``table_base[l] + c``. Layer ``l``
    writes its words right-aligned into ``out[out_off[l]:out_off[l+1]]`` (room for
    ``H * n * D + STATE_WORDS`` words) and records where they start in ``out_start[l]``.
    Symbols are pushed in reverse decoding order; full lane groups run unrolled with scalar
    states, like the decoder. (Quantizing inside this loop was measured slower than the
    separate, vectorized quantize pass.)
    """
    _, H, n, D = sym.shape
    C = H * D
    states = np.empty(LANES, dtype=np.uint64)
    lane_h = np.empty(LANES, dtype=np.int64)
    lane_d = np.empty(LANES, dtype=np.int64)
    for i in range(todo.shape[0]):
        layer = todo[i]
        p = out_off[layer + 1]
        for lane in range(LANES):
            states[lane] = _U_L
        for g in range(((C + LANES - 1) // LANES - 1) * LANES, -1, -LANES):
            active = min(LANES, C - g)
            for lane in range(active):
                lane_h[lane] = (g + lane) // D
                lane_d[lane] = g + lane - lane_h[lane] * D
            tb = table_base[layer] + g
            if active == LANES:
                x0, x1, x2, x3, x4, x5, x6, x7 = eight(states)
                h0, h1, h2, h3, h4, h5, h6, h7 = eight(lane_h)
                d0, d1, d2, d3, d4, d5, d6, d7 = eight(lane_d)
                for t in range(n - 1, -1, -1):
                    x7, p = _encode_step(x7, sym[layer, h7, t, d7], tb + 7, freq_cum, out, p)
                    x6, p = _encode_step(x6, sym[layer, h6, t, d6], tb + 6, freq_cum, out, p)
                    x5, p = _encode_step(x5, sym[layer, h5, t, d5], tb + 5, freq_cum, out, p)
                    x4, p = _encode_step(x4, sym[layer, h4, t, d4], tb + 4, freq_cum, out, p)
                    x3, p = _encode_step(x3, sym[layer, h3, t, d3], tb + 3, freq_cum, out, p)
                    x2, p = _encode_step(x2, sym[layer, h2, t, d2], tb + 2, freq_cum, out, p)
                    x1, p = _encode_step(x1, sym[layer, h1, t, d1], tb + 1, freq_cum, out, p)
                    x0, p = _encode_step(x0, sym[layer, h0, t, d0], tb + 0, freq_cum, out, p)
                states[0], states[1], states[2], states[3] = x0, x1, x2, x3
                states[4], states[5], states[6], states[7] = x4, x5, x6, x7
            else:
                for t in range(n - 1, -1, -1):
                    for lane in range(active - 1, -1, -1):
                        states[lane], p = _encode_step(
                            states[lane],
                            sym[layer, lane_h[lane], t, lane_d[lane]],
                            tb + lane,
                            freq_cum,
                            out,
                            p,
                        )
        for lane in range(LANES - 1, -1, -1):
            x = states[lane]
            p -= 1
            out[p] = x >> _U_16
            p -= 1
            out[p] = x & _U_FFFF
        out_start[layer] = p


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_step(x, tid, slot_sym, freq_cum, words, p, last):
    """One rANS decode step: (new state, new read position, symbol)."""
    slot = x & _U_MASK
    s = slot_sym[tid, slot]
    fc = np.uint64(freq_cum[tid, s])
    x = (fc >> _U_16) * (x >> _U_PB) + slot - (fc & _U_FFFF)
    w = np.uint64(words[min(p, last)])
    if x < _U_L:
        x = (x << _U_16) | w
        p += 1
    return x, p, s


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _emit(s, ctr, scale, pos, out_f32, out_bf16, to_bf16):
    """Dequantize symbol ``s`` and store it as float32 or as bfloat16 bits."""
    val = (np.float32(s) - ctr) * scale
    if to_bf16:
        out_bf16[pos] = f32_to_bf16(val)
    else:
        out_f32[pos] = val


@numba.njit(inline="always")
def read_states(words, w0, states):
    """Load the ``LANES`` final encoder states at the start of the stream at ``words[w0]`` into
    ``states``; returns the position of the stream's first renormalisation word."""
    for lane in range(LANES):
        states[lane] = np.uint64(words[w0 + 2 * lane]) | (
            np.uint64(words[w0 + 2 * lane + 1]) << _U_16
        )
    return w0 + STATE_WORDS


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_emit(x, tid, p, code, ctr, scale, at, out):
    """:func:`_decode_step` of the stream ``code`` (its tables, words and last word), then
    :func:`_emit` of the symbol to element ``at`` of ``out`` (float32 and bfloat16 outputs,
    and whether to write the bfloat16 one): (new state, new read position)."""
    slot_sym, freq_cum, words, last = code
    out_f32, out_bf16, to_bf16 = out
    x, p, s = _decode_step(x, tid, slot_sym, freq_cum, words, p, last)
    _emit(s, ctr, scale, at, out_f32, out_bf16, to_bf16)
    return x, p


@numba.njit(nogil=True, cache=True, boundscheck=False)
def decode_streams(
    words,
    word_off,
    num_channels,
    num_tokens,
    table_base,
    slot_sym,
    freq_cum,
    dequantize,
    todo,
    status,
):
    """Decode and dequantize streams ``todo``.

    ``freq_cum[table, symbol]`` packs ``freq << 16 | cum``. ``dequantize`` is the tuple
    ``(scales, scale_off, scale_stride, center, head_dim, token_map, token_off, out_f32,
    out_bf16, out_base, out_token_stride)``: symbol ``s`` of channel ``c`` and token ``t`` of
    stream ``k`` becomes ``(s - center[k]) * scales[scale_off[k] + (c // head_dim) * sh + t *
    st + c * sc]`` with ``(sh, st, sc) = scale_stride[k]``, written to element ``out_base[k] +
    (c // head_dim) * out_token_stride * head_dim + token_map[token_off[k] + t] * head_dim + c
    % head_dim`` of ``out_bf16`` (bfloat16 bits) if that is non-empty, else of ``out_f32``.
    ``status[k]`` becomes 0 when the stream decoded cleanly, 1 when it is corrupt.
    """
    tables = (slot_sym, freq_cum)
    scratch = (
        np.empty(LANES, dtype=np.uint64),  # lane states
        np.empty(LANES, dtype=np.int64),  # each lane's first scale
        np.empty(LANES, dtype=np.int64),  # each lane's first output element
    )
    for i in range(todo.shape[0]):
        k = todo[i]
        coded = (words, word_off[k], word_off[k + 1], num_channels[k], num_tokens[k])
        status[k] = _decode_stream(k, coded, table_base[k], tables, dequantize, scratch)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _decode_stream(k, coded, first_table, tables, dequantize, scratch):
    """Stream ``k`` of :func:`decode_streams` (``coded``: its words, their range, its channel
    and token counts); 0 if it decoded cleanly, else 1.

    Full groups of ``LANES`` channels run with the lanes unrolled into scalar states (kept in
    registers: about twice as fast as an array of states); a last partial group, if any,
    runs lane by lane."""
    words, w0, end, C, T = coded
    slot_sym, freq_cum = tables
    scales, scale_off, scale_stride, center, head_dim, token_map, token_off = dequantize[:7]
    out_f32, out_bf16, out_base, out_token_stride = dequantize[7:]
    states, lane_scale, lane_out = scratch
    st, ctr, to = scale_stride[k, 1], np.float32(center[k]), token_off[k]
    if end - w0 < STATE_WORDS:
        return 1
    p = read_states(words, w0, states)
    code = (slot_sym, freq_cum, words, end - 1)
    out = (out_f32, out_bf16, out_bf16.shape[0] > 0)
    slot_flat, fc_flat, fc_width = slot_sym.reshape(-1), freq_cum.reshape(-1), freq_cum.shape[1]
    slot_lines = LANES * PROB_SCALE // 64  # 64-byte cache lines of a group's slot tables
    fc_lines = (LANES * fc_width * 4 + 63) // 64
    for g in range(0, C, LANES):
        active = min(LANES, C - g)
        for lane in range(active):
            c = g + lane
            h = c // head_dim
            lane_scale[lane] = scale_off[k] + h * scale_stride[k, 0] + c * scale_stride[k, 2]
            lane_out[lane] = out_base[k] + h * out_token_stride * head_dim + (c - h * head_dim)
        tb = first_table + g
        if active == LANES:
            x0, x1, x2, x3, x4, x5, x6, x7 = eight(states)
            s0, s1, s2, s3, s4, s5, s6, s7 = eight(lane_scale)
            o0, o1, o2, o3, o4, o5, o6, o7 = eight(lane_out)
            # While this group decodes, prefetch the next group's tables: with short
            # streams (256 tokens) fetching them on demand stalls the decoder.
            nxt = (tb + LANES) * PROB_SCALE if g + 2 * LANES <= C else -1
            nxt_fc = (tb + LANES) * fc_width
            for t in range(T):
                if nxt >= 0:
                    if t < slot_lines:
                        prefetch(slot_flat, nxt + t * 64)
                    elif t < slot_lines + fc_lines:
                        prefetch(fc_flat, nxt_fc + (t - slot_lines) * 16)
                tok = token_map[to + t] * head_dim
                ts = t * st
                x0, p = _decode_emit(x0, tb, p, code, ctr, scales[s0 + ts], o0 + tok, out)
                x1, p = _decode_emit(x1, tb + 1, p, code, ctr, scales[s1 + ts], o1 + tok, out)
                x2, p = _decode_emit(x2, tb + 2, p, code, ctr, scales[s2 + ts], o2 + tok, out)
                x3, p = _decode_emit(x3, tb + 3, p, code, ctr, scales[s3 + ts], o3 + tok, out)
                x4, p = _decode_emit(x4, tb + 4, p, code, ctr, scales[s4 + ts], o4 + tok, out)
                x5, p = _decode_emit(x5, tb + 5, p, code, ctr, scales[s5 + ts], o5 + tok, out)
                x6, p = _decode_emit(x6, tb + 6, p, code, ctr, scales[s6 + ts], o6 + tok, out)
                x7, p = _decode_emit(x7, tb + 7, p, code, ctr, scales[s7 + ts], o7 + tok, out)
            states[0], states[1], states[2], states[3] = x0, x1, x2, x3
            states[4], states[5], states[6], states[7] = x4, x5, x6, x7
        else:
            for t in range(T):
                tok = token_map[to + t] * head_dim
                for lane in range(active):
                    scale = scales[lane_scale[lane] + t * st]
                    at = lane_out[lane] + tok
                    states[lane], p = _decode_emit(
                        states[lane], tb + lane, p, code, ctr, scale, at, out
                    )
    ok = p == end
    for lane in range(LANES):
        if states[lane] != _U_L:
            ok = False
    return 0 if ok else 1


def encode_rows(sym: np.ndarray, table_row: np.ndarray, freq_cum: np.ndarray) -> np.ndarray:
    """rANS words of symbols ``sym`` [kept, tokens], component ``c`` coded with table row
    ``table_row[c]``."""
    C, n = sym.shape
    view = np.ascontiguousarray(sym.T).reshape(1, 1, n, C)
    out_off = np.array([0, C * n + STATE_WORDS], dtype=np.int64)
    out = np.empty(int(out_off[-1]), dtype=np.uint16)
    start = np.empty(1, dtype=np.int64)
    encode_layers(
        view,
        np.zeros(1, np.int64),
        np.ascontiguousarray(freq_cum[table_row]),
        out,
        out_off,
        np.zeros(1, np.int64),
        start,
    )
    return out[int(start[0]) :]
