"""The ``tcq`` encoder: a chunk's frame body (layout in :mod:`cachegen.codec.tcq.codec`).

Each (layer, K/V) stream's rows go through their level's analysis matrix into symbols of
the kept components (:func:`quantize_rows`: one product, then one kernel pass that finds the
offsets and rounds); in adaptive frames each component also gets an offset and the table
that codes its symbols in the fewest bits (:func:`choose_tables`)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from cachegen.codec.base import kv_tensor
from cachegen.codec.coding import rans
from cachegen.codec.coding.parallel import run_batches
from cachegen.codec.tcq import kernels as tcq_kernels
from cachegen.codec.tcq.code import (
    OFFSET_UNITS,
    ZLIB_LEVEL,
    LevelCode,
    exact_count,
    table_rows,
)
from cachegen.codec.tcq.model import TcqModel
from cachegen.codec.tcq.predict import residual_symbols
from cachegen.codec.tcq.refine import encode_refinement, refined_rows, refinement_symbols
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.kv import KVCache


def quantize_rows(
    tcq: TcqModel,
    code: LevelCode,
    layer: int,
    kind: int,
    rows: torch.Tensor,
    centred: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symbols ``[kept, tokens]`` (uint8) of ``rows`` [tokens, channels] (float32, pre-RoPE
    keys or values of layer ``layer``), each kept component's offset (int8, in
    1 / OFFSET_UNITS steps: the median of its coefficients when ``centred``, else 0: the
    quantizer's grid moves with it), and the coefficients in steps less the offsets
    [kept, tokens] (float32)."""
    mean = torch.from_numpy(tcq.mean[layer, kind])
    return _quantize_deviations(code, layer, kind, rows - mean, centred)


def _quantize_deviations(
    code: LevelCode, layer: int, kind: int, deviations: torch.Tensor, centred: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`quantize_rows` of rows whose channel means are already subtracted."""
    y = (code.analysis[layer][kind] @ deviations.T).numpy()  # [kept, tokens], in steps
    sym = np.empty(y.shape, dtype=np.uint8)
    offset = np.empty(y.shape[0], dtype=np.int8)
    radius = code.radius[layer][kind]
    tcq_kernels.quantize_coefficients(y, radius, centred, OFFSET_UNITS, sym, offset)
    return sym, offset, y


def choose_tables(code: LevelCode, rows: np.ndarray, radius: np.ndarray, sym: np.ndarray):
    """Each kept component's table (uint8: 0 its calibrated table, row ``rows[c]``, ``1 + j``
    family table ``j``), the one that codes its symbols ``sym`` [kept, tokens] in the fewest
    bits (the first of the family's cheapest, and only where it is cheaper than the calibrated
    one)."""
    choice = np.zeros(len(radius), dtype=np.uint8)
    tcq_kernels.choose_tables(sym, radius, rows, code.code_bits, *code.family_bits, choice)
    return choice


@dataclass
class FrameSymbols:
    """A frame's exact tokens (bytes), how many tokens follow them (``m``), and per (layer,
    K/V) stream the symbols [kept, m] (uint8) and offsets [kept] (int8) of
    :func:`quantize_rows` (empty for a stream without kept components, or when ``m`` is 0);
    in a refined frame also its refined rows [layers, m] and each stream's refinement symbols
    [kept, refined tokens] (:mod:`cachegen.codec.tcq.refine`)."""

    exact: bytes
    m: int
    symbols: list[np.ndarray]
    offsets: list[np.ndarray]
    refined: np.ndarray | None = None
    refinements: list[np.ndarray] = field(default_factory=list)


def frame_symbols(tcq: TcqModel, code: LevelCode, chunk: KVCache, refine: bool = False):
    """The :class:`FrameSymbols` of ``chunk`` at the level of ``code`` (streams in the codec's
    threads), with its refined rows where ``refine``."""
    layers = list(chunk.layer_indices)
    e = exact_count(chunk.start, chunk.num_tokens)
    x = kv_tensor(chunk)
    exact = x[:, :, :, :e].contiguous().view(torch.uint8).numpy().tobytes()
    q = x[:, :, :, e:].to(torch.float32)
    thetas = tuple(tcq.rope_thetas[i] for i in layers)
    if any(thetas):
        q[0] = rotate_layer_keys(q[0], chunk.start + e, thetas, inverse=True)
    L, H, m, D = q.shape[1:]
    none = np.zeros((0, m), dtype=np.uint8)
    frame = FrameSymbols(exact, m, [none] * (2 * L), [np.zeros(0, np.int8)] * (2 * L))
    if refine and m:
        frame.refined = refined_rows(q[1])
        frame.refinements = [np.zeros((0, 0), dtype=np.uint8)] * (2 * L)

    # every stream's rows [tokens, channels] less their means, laid out in one pass
    rows = q.permute(1, 0, 3, 2, 4).reshape(L, 2, m, H * D)
    deviations = rows - torch.from_numpy(tcq.mean[layers])[:, :, None, :]

    def kernel(todo: np.ndarray) -> None:
        for s in todo:
            i, k = divmod(int(s), 2)
            if not len(code.kept[layers[i]][k]) or not m:
                continue
            sym, frame.offsets[s], y = _quantize_deviations(
                code, layers[i], k, deviations[i, k], tcq.adaptive
            )
            frame.symbols[s] = sym
            if frame.refined is not None:
                rows_i = frame.refined[i]
                radius = code.radius[layers[i]][k]
                frame.refinements[s] = refinement_symbols(y[:, rows_i], sym[:, rows_i], radius)

    run_batches(kernel, np.array([len(code.kept[lay][k]) + 1 for lay in layers for k in (0, 1)]))
    return frame


def encode_body(tcq: TcqModel, code: LevelCode, chunk: KVCache, refine: bool = False) -> bytes:
    """The frame body of ``chunk`` at the level of ``code`` (its predicted layers' targets
    coded as residuals: :mod:`cachegen.codec.tcq.predict`; its sinks' rows refined where
    ``refine``: :mod:`cachegen.codec.tcq.refine`)."""
    layers = tuple(chunk.layer_indices)
    frame = frame_symbols(tcq, code, chunk, refine)
    symbols = frame.symbols
    predicted = code.predicted_layers(layers) if frame.m else []
    if predicted:
        radius = [code.radius[layer][k] for layer in layers for k in (0, 1)]
        symbols = residual_symbols(predicted, radius, symbols, frame.offsets)
    count = 2 * len(layers)
    streams: list[np.ndarray] = [np.zeros(0, dtype=np.uint16)] * count
    choices = [np.zeros(0, dtype=np.uint8)] * count

    positions = {i for i, _ in predicted}

    def kernel(todo: np.ndarray) -> None:
        for s in todo:
            sym = symbols[int(s)]
            if not sym.size:
                continue
            layer, k = layers[s // 2], s % 2
            radius = code.radius[layer][k]
            table_row = code.calibrated_rows(layer, k, s // 2 in positions)
            if tcq.adaptive:
                choices[s] = choose_tables(code, table_row, radius, sym)
                table_row = table_rows(code, radius, choices[s], table_row)
            streams[s] = rans.encode_rows(sym, table_row, code.freq_cum)

    run_batches(kernel, np.array([len(sym) + 1 for sym in symbols]))
    lengths = np.array([len(w) for w in streams], dtype="<u4")
    side = b""
    if tcq.adaptive and frame.m:
        offsets = [o.view(np.uint8) for o in frame.offsets]
        packed = zlib.compress(np.concatenate(offsets + choices).tobytes(), ZLIB_LEVEL)
        side = np.array([len(packed)], dtype="<u4").tobytes() + packed
    if frame.refined is not None:
        side += encode_refinement(tcq, frame.refined, frame.refinements)
    exact = frame.exact
    return exact + side + lengths.tobytes() + np.concatenate(streams).astype("<u2").tobytes()
