"""Refined rows: a frame's attention sinks coded a quarter step finer.

A few tokens draw much of many heads' attention while adding little to their outputs: their
values are small (attention sinks). An error in their keys moves the attention every later
query pays them, so their error costs far more than an average token's, which the
per-component weights (an average over tokens) cannot see. So each coded frame finds, per
layer, the tokens whose values' norm (the mean over heads) is below ``REFINE_BELOW`` of the
frame's median, and codes those rows' keys and values twice: the usual symbol ``q`` in its
stream, and a refinement ``r = round(4 (y - q))`` in ``[-2, 2]`` of each kept component's
coefficient ``y`` (in steps, less the frame's offset), so the row decodes to ``q + r / 4``
steps, the error of a quarter of the step. The rows are about 1% of a frame; their
refinement symbols go through rANS with one of the model file's family tables for radius 2,
the one that codes them in the fewest bits.

Refinement section of a frame body (docs/bitstream.md, "Refined rows")::

    u32 byte count N of what follows (0: no refined row)
    u8  table: family table j for radius 2
    u32 byte count B of the mask, then B bytes: DEFLATE (zlib) of the mask [layers, tokens - e]
        as bits, little bit order within a byte
    u16 rANS words (layout in rans.py): one stream of the refinement symbols (r + 2), per
        (layer, K/V) stream in stream order, per refined token in order, its kept components;
        coded as 8 components, symbol i component i % 8 of token i // 8, the last token
        padded with symbol 2

The decoder adds the refinements to the coefficients before the synthesis product where
that product runs in floats; the integer product cannot hold quarters, so there the kernel,
right after a stream's own rows (its matrix still in cache), multiplies each refined row's
symbols ``r`` by the stream's integer synthesis and adds the product, divided by 4 and keys
turned to their position, to the row it wrote (``int_synthesis.Refinements``)."""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from cachegen.codec.coding import rans
from cachegen.codec.errors import CodecError
from cachegen.codec.tcq import int_synthesis
from cachegen.codec.tcq import kernels as tcq_kernels
from cachegen.codec.tcq.code import ZLIB_LEVEL, code_lengths, family_tables
from cachegen.codec.tcq.model import TcqModel
from cachegen.codec.transform.packing import inflate_exactly

REFINE_BELOW = 0.5  # a row is refined where its values' norm is below this share of the median
REFINE_UNITS = 4  # refinements are in 1 / REFINE_UNITS of a step
REFINE_RADIUS = REFINE_UNITS // 2


def refined_rows(values: torch.Tensor) -> np.ndarray:
    """Which rows of a frame to refine, [layers, tokens] (bool), from its values [layers,
    heads, tokens, head_dim] (float32): those whose norm, the mean over heads, is below
    ``REFINE_BELOW`` of the layer's median over the frame."""
    norm = values.norm(dim=-1).mean(dim=1)  # [layers, tokens]
    if norm.shape[1] < 2:
        return np.zeros(tuple(norm.shape), dtype=bool)
    median = norm.median(dim=1, keepdim=True).values
    return (norm < REFINE_BELOW * median).numpy()


def refinement_symbols(y: np.ndarray, sym: np.ndarray, radius: np.ndarray) -> np.ndarray:
    """The refinement symbols ``r + REFINE_RADIUS`` [kept, tokens] (uint8) of coefficients
    ``y`` [kept, tokens] (in steps, less the frame's offsets) that the stream codes as
    ``sym`` (its symbols, radii added)."""
    fine = np.round(REFINE_UNITS * (y - (sym.astype(np.float32) - radius[:, None])))
    return (np.clip(fine, -REFINE_RADIUS, REFINE_RADIUS) + REFINE_RADIUS).astype(np.uint8)


@functools.lru_cache(maxsize=8)
def refinement_tables(tcq: TcqModel) -> tuple[np.ndarray, np.ndarray]:
    """(freq_cum, slot_sym) of the model file's family tables for radius ``REFINE_RADIUS``,
    made once per model file (a model file hashes by identity)."""
    freq = family_tables(tcq.family, REFINE_RADIUS)
    return rans.pack_freq_cum(freq), rans.slot_table(freq)


def encode_refinement(tcq: TcqModel, mask: np.ndarray, symbols: list[np.ndarray]) -> bytes:
    """The refinement section of a frame of model file ``tcq`` whose refined rows are
    ``mask`` [layers, tokens] and whose streams' refinement symbols are ``symbols`` (each
    [kept, refined tokens] of its layer)."""
    flat = np.concatenate([s.T.reshape(-1) for s in symbols] + [np.zeros(0, np.uint8)])
    if not flat.size:
        return np.zeros(1, dtype="<u4").tobytes()
    freq_cum, _ = refinement_tables(tcq)
    counts = np.bincount(flat, minlength=2 * REFINE_RADIUS + 1)
    bits = code_lengths(freq_cum) @ counts
    table = int(np.argmin(bits))
    packed = zlib.compress(np.packbits(mask, bitorder="little").tobytes(), ZLIB_LEVEL)
    padded = np.full(-(-len(flat) // rans.LANES) * rans.LANES, REFINE_RADIUS, dtype=np.uint8)
    padded[: len(flat)] = flat
    lanes = padded.reshape(-1, rans.LANES).T  # symbol i: component i % 8 of token i // 8
    words = rans.encode_rows(lanes, np.zeros(rans.LANES, np.int64), freq_cum[table][None])
    body = bytes([table]) + np.array([len(packed)], "<u4").tobytes() + packed
    body += words.astype("<u2").tobytes()
    return np.array([len(body)], dtype="<u4").tobytes() + body


@dataclass
class Refinement:
    """A frame's refined rows: ``mask`` [layers, tokens], and where the section's rANS words
    are (``table``: the family table's index)."""

    mask: np.ndarray
    table: int
    words: np.ndarray


def read_refinement(body, at: int, layers: int, tokens: int, where: str):
    """(bytes, :class:`Refinement` or None) of the refinement section at byte ``at`` of a
    frame body of ``layers`` x ``tokens`` rows; ``CodecError`` where it does not fit."""
    if len(body) < at + 4:
        raise CodecError(f"{where} body is {len(body)} bytes, too short for its refinement")
    (size,) = np.frombuffer(body, dtype="<u4", count=1, offset=at)
    size, start = int(size), at + 4
    if not size:
        return 4, None
    if size < 5 or start + size > len(body):
        raise CodecError(f"{where} refinement runs past the body")
    table = body[start]
    (packed,) = np.frombuffer(body, dtype="<u4", count=1, offset=start + 1)
    rest = size - 5 - int(packed)
    if rest < 0 or rest % 2:
        raise CodecError(f"{where} refinement mask runs past its section")
    raw = inflate_exactly(
        body[start + 5 : start + 5 + int(packed)],
        (layers * tokens + 7) // 8,
        f"{where} refinement mask does not inflate",
        f"{where} refinement mask is not one bit per row",
    )
    bits = np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")
    if bits[layers * tokens :].any():
        raise CodecError(f"{where} refinement mask has bits past its rows")
    words = np.frombuffer(body, dtype="<u2", count=rest // 2, offset=start + 5 + int(packed))
    mask = bits[: layers * tokens].reshape(layers, tokens).astype(bool)
    return 4 + size, Refinement(mask, int(table), words)


@dataclass
class RefinedRows:
    """A frame's refinements row by row, in stream order: ``rows`` [n, width] (int16, -2 to
    2; 0 past its stream's kept components) of stream ``stream[i]`` at coded token
    ``token[i]``, stream ``k``'s rows from ``start[k]`` to ``start[k + 1]``."""

    rows: np.ndarray
    stream: np.ndarray
    token: np.ndarray
    start: np.ndarray

    def integer(self) -> int_synthesis.Refinements:
        """The integer product's refinements of these rows, in quarters of a step."""
        return int_synthesis.Refinements(self.rows, self.start, self.token, 1 / REFINE_UNITS)

    def add_to(self, coefficients: torch.Tensor) -> None:
        """Add the refinements, in steps, to a frame's coefficients [streams, tokens, width]
        (float32 or bfloat16)."""
        at = (torch.from_numpy(self.stream), torch.from_numpy(self.token))
        fine = torch.from_numpy(self.rows).float() / REFINE_UNITS
        coefficients[at] = (coefficients[at].float() + fine).to(coefficients.dtype)


def read_refined(
    refinement: Refinement, tcq: TcqModel, kept: np.ndarray, width: int, where: str
) -> RefinedRows:
    """The :class:`RefinedRows` of a frame of model file ``tcq``, its section's words decoded
    (``kept``: the streams' kept component counts, at most ``width``); ``CodecError`` where
    they do not decode."""
    if refinement.table >= len(tcq.family):
        raise CodecError(f"{where} refinement names a table the family does not have")
    stream, token, start = tcq_kernels.refined_rows_of(refinement.mask, kept)
    total = int(kept[stream].sum())
    if not total:
        raise CodecError(f"{where} refinement has no refined row")
    rows = tcq_kernels.spread_rows(_decoded(refinement, tcq, total, where), stream, kept, width)
    return RefinedRows(rows, stream, token, start)


def _decoded(refinement: Refinement, tcq: TcqModel, total: int, where: str) -> np.ndarray:
    """The section's ``total`` refinement symbols less ``REFINE_RADIUS`` (int16): one rANS
    stream of ``LANES`` components, symbol ``i`` component ``i % LANES`` of token
    ``i // LANES``, the last token padded with zeros."""
    freq_cum, slot_sym = refinement_tables(tcq)
    lanes, tokens = rans.LANES, -(-total // rans.LANES)
    out = np.empty(tokens * lanes, dtype=np.int16)
    status = np.zeros(1, dtype=np.uint8)
    tcq_kernels.decode_coefficients(
        refinement.words,
        np.array([0, len(refinement.words)], dtype=np.int64),
        np.array([lanes], dtype=np.int64),
        np.full(lanes, refinement.table, dtype=np.int64),
        np.full(lanes, REFINE_RADIUS, dtype=np.int64),
        np.zeros(1, dtype=np.int64),
        slot_sym,
        freq_cum,
        out,
        tokens,
        lanes,
        np.zeros(1, dtype=np.int64),
        status,
    )
    if status.any() or np.any(out[total:]):
        raise CodecError(f"{where} refinement's rANS stream does not decode")
    return out[:total]
