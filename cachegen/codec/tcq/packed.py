"""The packed form of a ``tcq`` level: the same symbols bit-packed per component instead of
rANS-coded.

A level's symbols (the same quantizer, offsets and exact tokens as its coded form, so both forms
decode to the same KV but for the coded form's refined rows, which the packed form does not
refine: :mod:`cachegen.codec.tcq.refine`) are stored at a fixed width per kept component and
frame: the fewest bits that hold the component's symbols in the frame less their smallest
(``low``). Larger than the coded form, it needs no tables and no rANS decoding: the decoder
unpacks eight symbols per load, then runs the coded form's synthesis and store passes
(:mod:`cachegen.codec.tcq.decode`). Frame body (``encode(kv, level, form="packed")``, header
flag bit 3)::

    exact      as the coded form: tokens at positions below EXACT_TOKENS, keys then values
               [L, H, e, D] in the KV's dtype (empty in most frames)
    side       (frames with a token past the exact ones) for every kept component, streams in
               (layer, K/V) order: its offset (i8, quarter steps; model files with a table
               family only, as the coded form's choices), then every component's ``low`` (u8),
               then every component's ``width`` (u8, 0 to 8)
    data       for every stream, for every kept component with a width: its ``m`` symbols
               less ``low`` in groups of eight tokens, each group ``width`` bytes (symbol ``j``
               of the group is bits ``[j * width, (j + 1) * width)``, little-endian bit order),
               the last group padded with zero bits

A component's width may not exceed what its alphabet needs above its low
(``(2 * radius - low).bit_length()``): the decoder refuses other widths and lows as corrupt.
"""

from __future__ import annotations

import numba
import numpy as np

from cachegen.codec.cachegen.kernels import store_value
from cachegen.codec.cachegen.packed import load_u64le
from cachegen.codec.coding.bitstream import Frame
from cachegen.codec.errors import CodecError
from cachegen.codec.tcq.code import LevelCode, StreamTables, exact_count
from cachegen.codec.tcq.decode import SymbolPass, TcqDecoder, checked_offsets
from cachegen.codec.tcq.encode import frame_symbols
from cachegen.codec.tcq.model import TcqModel
from cachegen.kv import KVCache

GROUP = 8  # symbols per packed group: one 64-bit load holds a group of up to 8-bit symbols
MAX_WIDTH = 8
_WORD_SLACK = 8  # bytes after the data, so that a group's 64-bit load stays inside the buffer


def group_bytes(m: int, width: np.ndarray) -> np.ndarray:
    """Bytes of each component's packed symbols for ``m`` tokens at ``width`` bits."""
    return -(-m // GROUP) * width.astype(np.int64)


def encode_packed_body(tcq: TcqModel, code: LevelCode, chunk: KVCache) -> bytes:
    """The packed form's frame body of ``chunk`` at the level of ``code``."""
    frame = frame_symbols(tcq, code, chunk)
    if not frame.m:
        return frame.exact
    lows, widths, data = [], [], []
    for sym in (s for s in frame.symbols if s.size):
        low = sym.min(axis=1)
        width = _bit_length(sym.max(axis=1) - low)
        out = np.zeros(int(group_bytes(frame.m, width).sum()), dtype=np.uint8)
        pack_components(sym, low, width, out)
        lows.append(low), widths.append(width), data.append(out)
    offsets = [o.view(np.uint8) for o in frame.offsets] if tcq.adaptive else []
    return frame.exact + np.concatenate(offsets + lows + widths + data).tobytes()


def _bit_length(values: np.ndarray) -> np.ndarray:
    """Bits that hold each of ``values`` (non-negative, below 256), uint8."""
    return np.ceil(np.log2(values.astype(np.float64) + 1)).astype(np.uint8)


class PackedLayout:
    """Where a packed frame body's parts are, checked against the body and the level's kept
    components and radii (``CodecError`` otherwise)."""

    def __init__(
        self, frame: Frame, streams: StreamTables, e: int, exact: int, m: int, adaptive: bool
    ):
        body, where = frame.body, f"frame {frame.index} is corrupt: tcq packed"
        kept = int(streams.kept.sum())
        self.exact_tokens, self.exact_bytes = e, exact
        self.refinement = None  # the packed form refines no row
        side = (3 if adaptive else 2) * kept if m else 0
        if len(body) < exact + side:
            raise CodecError(f"{where} body is {len(body)} bytes, too short for its side data")
        raw = np.frombuffer(body, dtype=np.uint8, count=side, offset=exact)
        fields = raw.reshape(-1, kept) if m else np.zeros((3, 0), np.uint8)
        self.offsets = checked_offsets(fields[0].view(np.int8), where) if adaptive else None
        self.low, self.width = fields[-2], fields[-1]
        room = 2 * streams.radius_int - self.low
        if np.any(room < 0) or np.any(self.width > _bit_length(np.maximum(room, 0))):
            raise CodecError(f"{where} symbols' lows or widths do not fit their alphabets")
        sizes = np.concatenate([[0], np.cumsum(group_bytes(m, self.width))])
        first = streams.radius_off
        per_stream = sizes[first + streams.kept] - sizes[first]
        self.data_at = exact + side
        if self.data_at + int(sizes[-1]) != len(body):
            raise CodecError(f"{where} symbols do not add up to the body")
        self.stream_off = np.concatenate([[0], np.cumsum(per_stream)]).astype(np.int64)
        self.stream_bytes = per_stream

    def data(self, body: bytes) -> np.ndarray:
        """The body's packed symbols with a few zero bytes after them."""
        out = np.zeros(len(body) - self.data_at + _WORD_SLACK, dtype=np.uint8)
        out[: len(body) - self.data_at] = np.frombuffer(body, dtype=np.uint8, offset=self.data_at)
        return out


class TcqPackedDecoder(TcqDecoder):
    """Decodes the packed form: the symbols unpacked, then the coded form's synthesis."""

    def _layout(self, frame: Frame) -> PackedLayout:
        h = self.header
        n = len(frame.token_ids)
        e = exact_count(self._frame_start(frame), n)
        exact = 2 * h.num_layers * h.num_kv_heads * e * h.head_dim * h.dtype.itemsize
        return PackedLayout(frame, self.streams, e, exact, n - e, self.adaptive)

    def _symbols(self, frame: Frame, layout: PackedLayout, out: np.ndarray, m: int) -> SymbolPass:
        streams = self.streams
        data = layout.data(frame.body)

        def unpack_kernel(todo: np.ndarray) -> None:
            unpack_coefficients(
                data,
                layout.stream_off,
                streams.kept,
                streams.radius_off,
                streams.radius_int,
                layout.low,
                layout.width,
                out,
                m,
                streams.width,
                todo,
            )

        return SymbolPass(unpack_kernel, layout.stream_bytes + streams.kept + 1, lambda: None)

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        layout = self._layout(frame)
        h = self.header
        per_stream = layout.stream_bytes.astype(np.float64).reshape(h.num_layers, 2)
        return per_stream + layout.data_at / (2 * h.num_layers)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def pack_components(sym, low, width, out):
    """Pack every component of ``sym`` [components, m] (uint8) less its ``low`` at its
    ``width`` bits, in groups of eight tokens, one component after another, into ``out``
    (zeroed, :func:`group_bytes` long)."""
    C, m = sym.shape
    p = 0
    for c in range(C):
        w = np.uint64(width[c])
        if w == 0:
            continue
        for g in range(0, m, 8):
            acc = np.uint64(0)
            for j in range(min(8, m - g)):
                acc |= np.uint64(sym[c, g + j] - low[c]) << (w * np.uint64(j))
            for b in range(width[c]):
                out[p + b] = np.uint8((acc >> np.uint64(8 * b)) & np.uint64(0xFF))
            p += width[c]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def unpack_coefficients(
    data, stream_off, kept, radius_off, radius, low, width, out, T, out_width, todo
):
    """Streams ``todo`` of a packed frame's ``data`` into ``out``, flat [streams, T,
    out_width] (float32, int16, or bfloat16 bits if uint16): stream ``k``'s component ``c`` (kept
    component ``j = radius_off[k] + c``) decodes to ``out[k, t, c] = low[j] + field - radius[j]``
    (the coded form's ``symbol - radius``), and ``out[k, t, c]`` is 0 for ``c >= kept[k]``."""
    for i in range(todo.shape[0]):
        k = todo[i]
        C = kept[k]
        for t in range(T):
            out[(k * T + t) * out_width + C : (k * T + t + 1) * out_width] = 0
        p = stream_off[k]
        for c in range(C):
            j = radius_off[k] + c
            w = width[j]
            centre = np.float32(radius[j] - low[j])
            at = k * T * out_width + c
            if w == 0:
                for t in range(T):
                    store_value(out, at + t * out_width, -centre)
                continue
            uw = np.uint64(w)
            mask = (np.uint64(1) << uw) - np.uint64(1)
            for g in range(0, T, 8):
                word = load_u64le(data, p)
                for lane in range(min(8, T - g)):
                    field = (word >> (uw * np.uint64(lane))) & mask
                    store_value(out, at + (g + lane) * out_width, np.float32(field) - centre)
                p += w
