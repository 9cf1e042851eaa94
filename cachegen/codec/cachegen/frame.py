"""The pieces of decoding one cachegen frame that do not depend on its form: the scales and
token map the symbol kernels dequantize with, the float32 scratch, the transform arguments
of the packed kernel, undoing a level's transforms on the scratch, and the views the
kernels write through. :meth:`cachegen_decode.LevelDecoder.frame_job` puts them together."""

from __future__ import annotations

import threading

import numpy as np
import torch

from cachegen.codec.cachegen.kernels import store_transformed

NO_ANGLES = torch.zeros(1, 1)

_scratch_buffers = threading.local()


def scratch(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 buffer reused by every frame this thread decodes. A fresh one per frame costs
    page faults, a large share of a frame's decoding (docs/codec.md, "Speed"), and the
    connector decodes each chunk as its own bitstream, with its own decoder."""
    size = int(np.prod(shape))
    buffer = getattr(_scratch_buffers, "float32", None)
    if buffer is None or buffer.numel() < size:
        buffer = _scratch_buffers.float32 = torch.empty(size, dtype=torch.float32)
    return buffer[:size].view(shape)


def frame_steps(
    body: memoryview, pos: int, layout: list, levels: list, num_layers: int, first_token: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scales section at ``body[pos:]``, fp16 absolute maxima per layout entry, as
    float32 steps (``amax / max_level`` per layer, ``levels``), each entry's first step, and
    the token map: each entry's token positions plus ``first_token``."""
    steps, first_step, token_maps = [], [], []
    total = 0
    for (_, tokens, count), level in zip(layout, levels):
        amax = (
            np.frombuffer(body[pos : pos + 2 * count], dtype="<f2")
            .astype(np.float32)
            .reshape(num_layers, -1)
        )
        pos += 2 * count
        steps.append((amax / level).reshape(-1))
        first_step.append(total)
        total += count
        token_maps.append(tokens.numpy().astype(np.int64) + first_token)
    scales = np.concatenate(steps) if steps else np.zeros(0, np.float32)
    return scales, np.asarray(first_step, dtype=np.int64), np.concatenate(token_maps)


def row_transform(
    hadamard: bool, rotary: list, n: int, segments: int, active: bool
) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray]:
    """The ``transform`` argument of ``packed.decode_streams`` for a frame of ``n`` tokens:
    whether to undo the Hadamard product, the cos and sin rows of every run of layers with a
    rotary base (``rotary`` as ``LevelDecoder.frame_job`` builds it) stacked, and each
    stream's first row of them (keys only; -1: not turned). Nothing to undo unless
    ``active``."""
    angle_row = np.full(2 * segments * (rotary[-1][1] if rotary else 0), -1, dtype=np.int64)
    runs = [(a, b, angles) for a, b, angles in rotary if angles is not None] if active else []
    if not runs:
        return hadamard and active, NO_ANGLES.numpy(), NO_ANGLES.numpy(), angle_row
    for i, (a, b, _) in enumerate(runs):
        for layer in range(a, b):  # keys: the first ``segments`` streams of the layer
            angle_row[2 * segments * layer : 2 * segments * layer + segments] = i * n
    cos = np.concatenate([angles[0].numpy() for _, _, angles in runs])
    sin = np.concatenate([angles[1].numpy() for _, _, angles in runs])
    return hadamard, cos, sin, angle_row


def transform_layers(
    todo: np.ndarray, source: torch.Tensor, out: torch.Tensor, hadamard: bool, rotary: list
) -> None:
    """Undo the level's transforms on the decoded streams ``todo`` of ``source`` (the float32
    scratch ``[2, L, H, n, D]``) into ``out`` (the frame's tokens of the output).

    Streams are (layer, K/V) without locality and ``todo`` is a contiguous range, so its keys
    and its values are each a contiguous run of layers: transform them while they are in
    cache, in one numba pass (it releases the GIL)."""
    n, D = source.shape[3], source.shape[4]
    for k in range(2):
        layers = todo[todo % 2 == k] // 2
        if not len(layers):
            continue
        first, end = int(layers[0]), int(layers[-1]) + 1
        for run_first, run_end, angles in rotary:
            a, b = max(first, run_first), min(end, run_end)
            if a >= b:
                continue
            rows = out[k, a:b].view(-1, n, D)
            rotate = k == 0 and angles is not None
            cos, sin = angles if rotate else (NO_ANGLES, NO_ANGLES)
            store_transformed(
                source[k, a:b].reshape(-1, n, D).numpy(),
                hadamard,
                cos.numpy(),
                sin.numpy(),
                rotate,
                *strided_views(rows),
            )


def strided_views(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(float32 elements, bfloat16 bits) views of a CPU tensor of either dtype, any strides;
    the other one is empty (and of the same rank)."""
    if x.dtype == torch.bfloat16:
        return np.empty((0,) * x.dim(), np.float32), x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy(), np.empty((0,) * x.dim(), np.uint16)
