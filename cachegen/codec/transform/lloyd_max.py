"""Lloyd-Max scalar quantizers for a unit Gaussian, 1 to 8 bits, shared by the ``kvtc`` and
``turboquant`` codecs.

:func:`lloyd_max` computes each codebook in float64 from the Gaussian's closed-form cell
moments, so encoder and decoder on any machine get the same codebooks; :func:`quantize` /
:func:`dequantize` code unit-variance values with per-column bit widths.
"""

from __future__ import annotations

import functools
import math
from statistics import NormalDist

import numpy as np
import torch

from cachegen.codec.errors import CodecError

MAX_BITS = 8
_LLOYD_ITERATIONS = 300


def _pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + _erf(x / math.sqrt(2)))


def _cell_moments(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zeroth, first and second moments of the unit Gaussian over each cell ``edges[i:i+2]``
    (edges include -inf and +inf)."""
    pdf, cdf = _pdf(edges), _cdf(edges)
    with np.errstate(invalid="ignore"):
        xpdf = np.where(np.isfinite(edges), edges * pdf, 0.0)
    m0 = np.diff(cdf)
    m1 = -np.diff(pdf)
    m2 = m0 - np.diff(xpdf)
    return m0, m1, m2


@functools.lru_cache(maxsize=MAX_BITS + 1)
def lloyd_max(bits: int) -> tuple[np.ndarray, np.ndarray, float]:
    """``(levels, thresholds, mse)`` of the ``bits``-bit Lloyd-Max quantizer of N(0, 1):
    ``2**bits`` reconstruction levels, the ``2**bits - 1`` cell boundaries between them and
    the mean squared error. Started from the companding approximation (levels spread like
    N(0, 3)) and refined by Lloyd's iteration."""
    if not 1 <= bits <= MAX_BITS:
        raise CodecError(f"Lloyd-Max quantizers have 1..{MAX_BITS} bits, got {bits}")
    n = 1 << bits
    dist = NormalDist(0.0, math.sqrt(3.0))
    levels = np.array([dist.inv_cdf((k + 0.5) / n) for k in range(n)])
    for _ in range(_LLOYD_ITERATIONS):
        edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
        m0, m1, _ = _cell_moments(edges)
        levels = m1 / m0
    thresholds = (levels[1:] + levels[:-1]) / 2
    m0, m1, m2 = _cell_moments(np.concatenate([[-np.inf], thresholds, [np.inf]]))
    mse = float(np.sum(m2 - 2 * levels * m1 + levels * levels * m0))
    return levels, thresholds, mse


def gaussian_mse() -> np.ndarray:
    """MSE of the unit Gaussian quantized with 0..8 bits (0 bits: dropped, MSE 1)."""
    return np.array([1.0] + [lloyd_max(b)[2] for b in range(1, MAX_BITS + 1)])


@functools.lru_cache(maxsize=MAX_BITS + 1)
def _torch_codebook(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    levels, thresholds, _ = lloyd_max(bits)
    return torch.from_numpy(levels.astype(np.float32)), torch.from_numpy(
        thresholds.astype(np.float32)
    )


def quantize(y: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """Codes (uint8) of ``y`` [..., k] (unit-variance float32) with ``bits[j]`` bits in column
    ``j`` (1..8)."""
    codes = torch.empty(y.shape, dtype=torch.uint8)
    for b in np.unique(bits):
        cols = torch.from_numpy(np.flatnonzero(bits == b))
        _, thresholds = _torch_codebook(int(b))
        codes[..., cols] = torch.bucketize(y[..., cols].contiguous(), thresholds).to(torch.uint8)
    return codes


def dequantize(codes: torch.Tensor, bits: np.ndarray) -> torch.Tensor:
    """float32 values of ``codes`` [..., k] (see :func:`quantize`); codes past a column's
    alphabet are a ``CodecError``."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    for b in np.unique(bits):
        cols = torch.from_numpy(np.flatnonzero(bits == b))
        levels, _ = _torch_codebook(int(b))
        sel = codes[..., cols].to(torch.int64)
        if sel.numel() and int(sel.max()) >= levels.numel():
            raise CodecError(f"corrupt data: a {b}-bit code is out of range")
        out[..., cols] = levels[sel]
    return out
