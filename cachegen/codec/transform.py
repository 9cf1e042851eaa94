"""Transform coding machinery shared by the ``kvtc`` and ``turboquant`` codecs.

* Lloyd-Max scalar quantizers for a unit Gaussian (:func:`lloyd_max`), 1 to 8 bits, computed
  in float64 from the Gaussian's closed-form cell moments, so encoder and decoder on any
  machine get the same codebooks.
* :func:`fit_pca`: a per-layer KLT basis over all heads' channels together (``heads x
  head_dim`` dimensions), components sorted by variance.
* :func:`allocate_bits`: integer bits 0..8 per component for a total budget, minimizing the
  summed distortion ``variance * mse(bits)`` of the Lloyd-Max quantizer (a component given 0
  bits is dropped; greedy on the marginal gains, exact because ``mse`` is convex).
* :func:`quantize` / :func:`dequantize` (per-column bit widths) and :func:`pack_bits` /
  :func:`unpack_bits` (fixed-width codes, little-endian bit order).
* :class:`TransformBasis`: a model's fitted bases and bit allocations as a file: ``CGTR``, a
  u32 length, a canonical JSON header (schema, version, model identity, calibration, arrays,
  SHA-256 of the array bytes), then the arrays as raw little-endian bytes (no pickle). Its
  id is the SHA-256 of the file; reading checks both hashes and every shape against the
  model's geometry, and any mismatch is a ``CodecError``.

Nothing here fits a basis from a model: that runs the model and lives in ``cachegen.profiles``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

from cachegen.codec.errors import CodecError
from cachegen.codec.tables import profiles_dir
from cachegen.fileio import write_atomic
from cachegen.kv import KVError, ModelIdentity

MAX_BITS = 8
MAGIC = b"CGTR"
SCHEMA = "cachegen-transform-basis"
VERSION = 1
_MAX_HEADER_JSON = 1 << 20
_LLOYD_ITERATIONS = 300
# name -> (numpy dtype, shape given (layers, channels, levels))
_ARRAYS = {
    "mean": ("<f4", lambda L, C, n: (L, 2, C)),
    "components": ("<f4", lambda L, C, n: (L, 2, C, C)),
    "variances": ("<f4", lambda L, C, n: (L, 2, C)),
    "bits": ("u1", lambda L, C, n: (n, L, 2, C)),
}


# ---- Lloyd-Max quantizers for a unit Gaussian ----------------------------------------------


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


def pack_bits(codes: torch.Tensor, bits: int) -> bytes:
    """Codes (uint8, each below ``2**bits``) packed ``bits`` bits each, little-endian."""
    flat = codes.reshape(-1).numpy()
    planes = (flat[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: memoryview | bytes, bits: int, count: int) -> torch.Tensor:
    """``count`` codes of ``bits`` bits from :func:`pack_bits`'s bytes."""
    planes = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    planes = planes[: count * bits].reshape(count, bits)
    codes = (planes << np.arange(bits, dtype=np.uint8)).sum(axis=1, dtype=np.uint8)
    return torch.from_numpy(codes)


def packed_size(count: int, bits: int) -> int:
    return -(-count * bits // 8)


# ---- PCA and bit allocation -----------------------------------------------------------------


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


# ---- the basis file -------------------------------------------------------------------------


def _canonical(data: dict) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


# ---- the model-file container (a basis here, tcq's model in cachegen.codec.tcq) -------------


def pack_model_file(magic: bytes, header: dict, payload: bytes) -> bytes:
    """``magic``, the u32 length of the canonical JSON ``header`` (with the payload's SHA-256
    added), the header, then ``payload``."""
    raw = _canonical({**header, "payload_sha256": hashlib.sha256(payload).hexdigest()})
    return magic + struct.pack("<I", len(raw)) + raw + payload


def inflate_exactly(data: bytes, size: int, bad: str, wrong_size: str) -> bytes:
    """``data`` inflated by zlib, which must give exactly ``size`` bytes, end its stream and
    leave nothing after it. At most ``size + 1`` bytes are ever inflated, so a zlib bomb costs
    nothing. ``CodecError``: ``bad`` (with zlib's reason) for data that does not inflate,
    ``wrong_size`` otherwise."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, size + 1)
    except zlib.error as exc:
        raise CodecError(f"{bad} ({exc})") from exc
    if len(raw) != size or not inflater.eof or inflater.unused_data:
        raise CodecError(wrong_size)
    return raw


def unpack_model_file(
    data: bytes, magic: bytes, schema: str, version: int | tuple[int, ...]
) -> tuple[dict, bytes]:
    """The header and payload of a :func:`pack_model_file` file, its framing, schema, version
    (``version`` or one of them) and payload checksum checked (``ValueError`` otherwise)."""
    versions = version if isinstance(version, tuple) else (version,)
    if data[:4] != magic:
        raise ValueError("bad magic")
    (header_len,) = struct.unpack_from("<I", data, 4)
    if header_len > _MAX_HEADER_JSON or 8 + header_len > len(data):
        raise ValueError("header length is out of range")
    header = json.loads(data[8 : 8 + header_len])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    if header.get("schema") != schema or header.get("version") not in versions:
        raise ValueError(f"unsupported {header.get('schema')!r} version {header.get('version')!r}")
    payload = data[8 + header_len :]
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise ValueError("checksum of the arrays does not match")
    return header, payload


def parse_model_file(data: bytes, where: str, file_id: str | None, what: str, parse):
    """``parse(data)`` of a model file named ``where``, its content hash checked against
    ``file_id`` when given; any defect becomes a :class:`CodecError` saying what to do."""
    if file_id is not None and hashlib.sha256(data).hexdigest()[:32] != file_id:
        raise CodecError(
            f"{what} {where} is corrupt (checksum does not match its id {file_id[:16]}); "
            "delete the file and copy or refit it"
        )
    try:
        return parse(data)
    except (ValueError, KeyError, TypeError, struct.error, KVError) as exc:
        raise CodecError(
            f"{what} {where} is unreadable ({exc}); delete the file and copy or refit it"
        ) from exc


@dataclass
class TransformBasis:
    """A model's per-layer PCA bases for keys and values and their bit allocations.

    ``mean`` / ``variances`` [L, 2, C], ``components`` [L, 2, C, C] (rows: components),
    ``bits`` [levels, L, 2, C]; index 0 of the second axis is keys. ``levels`` maps each
    level id to its budget in bits per element before entropy coding, in increasing level
    order, the order of ``bits`` (the file's canonical JSON sorts its keys as text, so a
    reader can only rely on numeric order); ``rope_thetas`` are the rotary bases keys were
    turned back by before fitting.
    """

    model: ModelIdentity
    calibration: dict
    rope_thetas: tuple[float, ...]
    levels: dict[int, float]
    mean: np.ndarray
    components: np.ndarray
    variances: np.ndarray
    bits: np.ndarray

    def __post_init__(self) -> None:
        if list(self.levels) != sorted(self.levels):
            raise CodecError(
                f"transform levels must be in increasing order, got {list(self.levels)}"
            )

    @functools.cached_property
    def file_bytes(self) -> bytes:
        arrays = {name: getattr(self, name) for name in _ARRAYS}
        payload = b"".join(
            np.ascontiguousarray(arrays[name], dtype=_ARRAYS[name][0]).tobytes() for name in _ARRAYS
        )
        header = {
            "schema": SCHEMA,
            "version": VERSION,
            "model": self.model.to_dict(),
            "calibration": self.calibration,
            "rope_thetas": list(self.rope_thetas),
            "levels": {str(k): v for k, v in self.levels.items()},
            "arrays": {name: list(arrays[name].shape) for name in _ARRAYS},
        }
        return pack_model_file(MAGIC, header, payload)

    @functools.cached_property
    def id(self) -> str:
        return hashlib.sha256(self.file_bytes).hexdigest()[:32]

    @property
    def nbytes(self) -> int:
        return len(self.file_bytes)

    def level_bits(self, level: int) -> np.ndarray:
        """Bits [L, 2, C] of ``level``."""
        if level not in self.levels:
            raise CodecError(
                f"the transform {self.id[:16]} of {self.model.name} has no level {level}; "
                f"levels are {sorted(self.levels)}"
            )
        return self.bits[list(self.levels).index(level)]

    def check_model(self, model: ModelIdentity) -> None:
        """``CodecError`` unless this basis was fitted for ``model``."""
        mine = self.model
        if (mine.fingerprint, mine.num_layers, mine.num_kv_heads, mine.head_dim) != (
            model.fingerprint,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
        ):
            raise CodecError(
                f"the transform {self.id[:16]} was fitted for model {mine.name} "
                f"({mine.fingerprint[:12]}), not {model.name} ({model.fingerprint[:12]}); "
                f"fit one for {model.name} (cachegen.profiles.ensure_kvtc_basis)"
            )


def parse_basis(data: bytes, where: str, basis_id: str | None = None) -> TransformBasis:
    """Read and fully validate a basis file (``basis_id``: its content hash must match)."""
    return parse_model_file(data, where, basis_id, "transform", _parse)


def _parse(data: bytes) -> TransformBasis:
    header, payload = unpack_model_file(data, MAGIC, SCHEMA, VERSION)
    model = ModelIdentity.from_dict(header["model"])
    levels = {
        int(k): float(v) for k, v in sorted(header["levels"].items(), key=lambda kv: int(kv[0]))
    }
    L, C = model.num_layers, model.num_kv_heads * model.head_dim
    arrays, pos = {}, 0
    for name, (dtype, shape_of) in _ARRAYS.items():
        shape = shape_of(L, C, len(levels))
        if list(shape) != header["arrays"][name]:
            raise ValueError(f"{name} has shape {header['arrays'][name]}, expected {list(shape)}")
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if pos + size > len(payload):
            raise ValueError("arrays are truncated")
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=int(np.prod(shape)), offset=pos)
        arrays[name] = arrays[name].reshape(shape).copy()
        pos += size
    if pos != len(payload):
        raise ValueError("trailing bytes after the arrays")
    if arrays["bits"].size and int(arrays["bits"].max()) > MAX_BITS:
        raise ValueError(f"bit allocations above {MAX_BITS}")
    thetas = tuple(float(t) for t in header["rope_thetas"])
    if len(thetas) != L:
        raise ValueError("rope_thetas does not have one base per layer")
    return TransformBasis(
        model,
        dict(header["calibration"]),
        thetas,
        levels,
        **{name: arrays[name] for name in _ARRAYS},
    )


def transforms_dir() -> Path:
    return profiles_dir() / "transforms"


class ModelFiles:
    """Content-addressed model files of one kind in the transforms directory (``<id><suffix>``),
    kept in memory once read or written. An object stored here has ``id``, ``file_bytes`` and
    ``check_model``; ``parse(data, where, id)`` reads and validates one (``CodecError``).
    ``what`` names the kind in messages, ``fit`` says how to make a missing one."""

    def __init__(self, what: str, suffix: str, parse, fit: str) -> None:
        self.what, self.suffix, self.parse, self.fit = what, suffix, parse, fit
        self._cache: dict = {}
        self._lock = threading.Lock()

    def path(self, file_id: str) -> Path:
        return transforms_dir() / f"{file_id}{self.suffix}"

    def save(self, obj):
        """Store ``obj`` in the transforms directory (by content id) and keep it in memory."""
        path = self.path(obj.id)
        if not path.is_file():
            write_atomic(path, obj.file_bytes)
        with self._lock:
            self._cache[obj.id] = obj
        return obj

    def find(self, file_id: str, model: ModelIdentity):
        """The file ``file_id`` for ``model``: from memory, else read and validated from the
        transforms directory; ``CodecError`` if it is missing, corrupt or another model's."""
        with self._lock:
            obj = self._cache.get(file_id)
        if obj is None:
            path = self.path(file_id)
            if not path.is_file():
                raise CodecError(
                    f"{self.what} {file_id[:16]} for {model.name} is not in {transforms_dir()}; "
                    f"copy {path.name} from the encoding machine or fit it ({self.fit})"
                )
            obj = self.parse(path.read_bytes(), str(path), file_id)
            with self._lock:
                self._cache[file_id] = obj
        obj.check_model(model)
        return obj

    def forget(self) -> None:
        with self._lock:
            self._cache.clear()


BASES = ModelFiles(
    "transform",
    ".cgtr",
    parse_basis,
    "cachegen.profiles.ensure_kvtc_basis, any `cachegen eval --codec kvtc`",
)
basis_path, save_basis, find_basis = BASES.path, BASES.save, BASES.find
forget_cached_bases = BASES.forget
