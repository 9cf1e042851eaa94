"""The ``kvtc`` codec's transform: per-layer PCA bases and their bit allocations, as a file.

* :func:`fit_pca`: a per-layer KLT basis over all heads' channels together (``heads x
  head_dim`` dimensions), components sorted by variance.
* :func:`allocate_bits`: integer bits 0..8 per component for a total budget, minimizing the
  summed distortion ``variance * mse(bits)`` of the Lloyd-Max quantizer (a component given 0
  bits is dropped; greedy on the marginal gains, exact because ``mse`` is convex).
* :class:`TransformBasis`: a model's fitted bases and bit allocations as a model file
  (``CGTR``, :mod:`cachegen.codec.transform.model_file`).

Nothing here fits a basis from a model: that runs the model and lives in
``cachegen.fitting.kvtc``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from cachegen.codec.transform.lloyd_max import MAX_BITS, gaussian_mse
from cachegen.codec.transform.model_file import (
    ModelFile,
    ModelFiles,
    pack_arrays,
    pack_model_file,
    parse_model_file,
    read_arrays,
    read_rope_thetas,
    unpack_model_file,
)
from cachegen.kv import ModelIdentity

MAGIC = b"CGTR"
SCHEMA = "cachegen-transform-basis"
VERSION = 1
# name -> (numpy dtype, shape given (layers, channels, levels))
_ARRAYS = {
    "mean": ("<f4", lambda L, C, n: (L, 2, C)),
    "components": ("<f4", lambda L, C, n: (L, 2, C, C)),
    "variances": ("<f4", lambda L, C, n: (L, 2, C)),
    "bits": ("u1", lambda L, C, n: (n, L, 2, C)),
}


def fit_pca(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean [C], components [C, C], variances [C])`` of samples ``x`` [N, C]: the rows of
    ``components`` are orthonormal, sorted by decreasing variance, each signed so that its
    largest entry is positive (the same data gives the same basis)."""
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=0)
    centered = x - mean
    cov = centered.T @ centered / max(1, len(x))
    variances, vectors = np.linalg.eigh(cov)
    order = np.argsort(-variances, kind="stable")
    components = vectors[:, order].T
    signs = np.sign(components[np.arange(len(components)), np.abs(components).argmax(axis=1)])
    components *= np.where(signs == 0, 1.0, signs)[:, None]
    return mean, components, np.clip(variances[order], 0.0, None)


def allocate_bits(variances: np.ndarray, budget: int) -> np.ndarray:
    """Bits 0..8 per component (uint8) summing to at most ``budget``, minimizing
    ``sum(variance * mse(bits))``: the ``budget`` largest marginal gains, which form a
    prefix per component because the Lloyd-Max MSE is convex in the bits."""
    mse = gaussian_mse()
    gains = np.asarray(variances, dtype=np.float64)[:, None] * (mse[:-1] - mse[1:])[None, :]
    budget = max(0, min(int(budget), gains.size))
    chosen = np.argsort(-gains.ravel(), kind="stable")[:budget]
    chosen = chosen[gains.ravel()[chosen] > 0]
    return np.bincount(chosen // MAX_BITS, minlength=len(variances)).astype(np.uint8)


@dataclass
class TransformBasis(ModelFile):
    """A model's per-layer PCA bases for keys and values and their bit allocations.

    ``mean`` / ``variances`` [L, 2, C], ``components`` [L, 2, C, C] (rows: components),
    ``bits`` [levels, L, 2, C]; index 0 of the second axis is keys. ``levels`` maps each
    level id to its budget in bits per element before entropy coding, in increasing level
    order, the order of ``bits`` (the file's canonical JSON sorts its keys as text, so a
    reader can only rely on numeric order); ``rope_thetas`` are the rotary bases keys were
    turned back by before fitting.
    """

    kind = "transform"
    fitter = "cachegen.fitting.kvtc.ensure_kvtc_basis"

    model: ModelIdentity
    calibration: dict
    rope_thetas: tuple[float, ...]
    levels: dict[int, float]
    mean: np.ndarray
    components: np.ndarray
    variances: np.ndarray
    bits: np.ndarray

    def __post_init__(self) -> None:
        self.check_level_order("transform")

    @functools.cached_property
    def file_bytes(self) -> bytes:
        payload, shapes = pack_arrays(self, _ARRAYS)
        levels = {str(k): v for k, v in self.levels.items()}
        return pack_model_file(MAGIC, self.file_header(SCHEMA, VERSION, levels, shapes), payload)

    def level_bits(self, level: int) -> np.ndarray:
        """Bits [L, 2, C] of ``level``."""
        return self.bits[self.level_index(level)]


def parse_basis(data: bytes, where: str, basis_id: str | None = None) -> TransformBasis:
    """Read and fully validate a basis file (``basis_id``: its content hash must match)."""
    return parse_model_file(data, where, basis_id, "transform", _parse)


def _parse(data: bytes) -> TransformBasis:
    header, payload = unpack_model_file(data, MAGIC, SCHEMA, VERSION)
    model = ModelIdentity.from_dict(header["model"])
    levels = {
        int(k): float(v) for k, v in sorted(header["levels"].items(), key=lambda kv: int(kv[0]))
    }
    arrays, pos = read_arrays(header, payload, _ARRAYS, model, len(levels))
    if pos != len(payload):
        raise ValueError("trailing bytes after the arrays")
    if arrays["bits"].size and int(arrays["bits"].max()) > MAX_BITS:
        raise ValueError(f"bit allocations above {MAX_BITS}")
    thetas = read_rope_thetas(header, model)
    return TransformBasis(model, dict(header["calibration"]), thetas, levels, **arrays)


BASES = ModelFiles(
    "transform",
    ".cgtr",
    parse_basis,
    "cachegen.fitting.kvtc.ensure_kvtc_basis, any `cachegen eval --codec kvtc`",
)
basis_path, save_basis, find_basis = BASES.path, BASES.save, BASES.find
forget_cached_bases = BASES.forget
