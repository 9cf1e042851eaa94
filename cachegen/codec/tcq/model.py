"""The ``tcq`` codec's model file: everything its decoder shares with its encoder.

A :class:`TcqModel` is a model's PCA bases, component weights and, per level, each
component's quantizer step, alphabet radius and calibrated rANS table, plus the family of
generalized-Gaussian shapes a frame may choose tables from (format version 2; version 1
files have none) and the cross-layer predictor of its coded streams (format version 3:
``cachegen.codec.tcq.predict``). It is a model file (``CGTQ``,
:mod:`cachegen.codec.transform.model_file`) in the transforms directory, ``<id>.cgtq``,
built from the model only by ``cachegen.fitting.tcq.ensure_tcq_model``; a model's current one is
named by its reference, ``tcq.json`` next to its cachegen profile. The embedded models' files,
fitted by the current recipe, ship with the package (``cachegen/codec/calibrated/<id>.cgtq``), so
that every machine names the same one (docs/codec.md, "Shipped model files").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from cachegen.codec.cachegen.profile import SHIPPED_DIR
from cachegen.codec.coding import rans
from cachegen.codec.transform.model_file import (
    ModelFile,
    ModelFileRef,
    ModelFiles,
    pack_arrays,
    pack_model_file,
    parse_model_file,
    read_arrays,
    read_rope_thetas,
    unpack_model_file,
)
from cachegen.kv import ModelIdentity

MAX_RADIUS = (rans.MAX_ALPHABET - 1) // 2
MAGIC = b"CGTQ"
SCHEMA = "cachegen-tcq-model"
VERSION = 3  # 2 added the table family, 3 the predictor; older files still read (and write
# back byte for byte)
MAX_PREDICTOR_SHIFT = 24
# The table family: discretized exp(-(|s| / scale) ** shape), for each shape every scale
# (in steps) of a geometric grid; each table is truncated to its component's radius.
FAMILY_SHAPES = (0.6, 0.8, 1.0, 1.4)
FAMILY_SCALES = 16
FAMILY_SCALE_RANGE = (0.08, 24.0)
REF_SCHEMA = "cachegen-tcq-model-ref"
REF_VERSION = 1
# level -> bits per element its step costs on the calibration text (before the exact tokens)
LEVELS: dict[int, float] = {20: 0.75, 21: 1.0, 22: 1.25, 23: 1.5, 24: 2.0, 25: 2.5, 26: 3.0}
# name -> (numpy dtype, shape given (layers, channels, levels)); "freq" is variable-length
_ARRAYS = {
    "mean": ("<f4", lambda L, C, n: (L, 2, C)),
    "components": ("<f4", lambda L, C, n: (L, 2, C, C)),
    "weights": ("<f4", lambda L, C, n: (L, 2, C)),
    "radius": ("u1", lambda L, C, n: (n, L, 2, C)),
    "steps": ("<f4", lambda L, C, n: (n, L, 2, C)),
}


def family_weights() -> np.ndarray:
    """The family's one-sided integer weights [shapes * scales, MAX_RADIUS + 1] (uint32).
    They are computed once, at fitting time, and stored in the model file: the decoder
    derives its tables from these integers only, so it never depends on a machine's ``exp``."""
    scales = np.exp(np.linspace(*np.log(FAMILY_SCALE_RANGE), FAMILY_SCALES))
    a = np.arange(MAX_RADIUS + 1, dtype=np.float64)
    rows = [np.exp(-((a / b) ** shape)) for shape in FAMILY_SHAPES for b in scales]
    return np.round(np.array(rows) * 2.0**30).astype(np.uint32)


@dataclass(eq=False)
class TcqModel(ModelFile):
    """A model's bases, component weights and levels with their rANS tables.

    ``mean`` / ``weights`` [L, 2, C], ``components`` [L, 2, C, C] (rows: components),
    ``radius`` [levels, L, 2, C] (0: dropped), ``steps`` [levels, L, 2, C] each component's
    quantizer step (the level's step over ``sqrt(weight)``, or coarser where the radius would
    otherwise pass ``MAX_RADIUS``), ``freq`` the kept components' tables one after
    another (level, layer, K/V, component order), ``2 * radius + 1`` entries each, summing to
    ``rans.PROB_SCALE``. ``levels`` maps each level id to its (key step, value step), in
    increasing level order, the order of the per-level arrays (the file's canonical JSON sorts
    its keys as text, so a reader can only rely on numeric order).
    """

    kind = "tcq model"
    fitter = "cachegen.fitting.tcq.ensure_tcq_model"

    model: ModelIdentity
    calibration: dict
    rope_thetas: tuple[float, ...]
    levels: dict[int, tuple[float, float]]
    mean: np.ndarray
    components: np.ndarray
    weights: np.ndarray
    radius: np.ndarray
    steps: np.ndarray
    freq: np.ndarray
    family: np.ndarray = field(
        default_factory=lambda: np.zeros((0, MAX_RADIUS + 1), dtype=np.uint32)
    )
    # [L, 2, 2C, T] float16: layer l's first T key and value components from layer l - 1's
    # keys and values (coefficient units); empty without a predictor
    predictor: np.ndarray = field(default_factory=lambda: np.zeros((0, 2, 0, 0), np.float16))
    # [levels, L] uint8: the fixed-point shift of each level's and layer's integer predictor
    predictor_shift: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.uint8))
    # the residual tables of every level's predicted layers' targets, one after another
    # (:func:`residual_table_offsets`), u16
    residual_freq: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint16))

    def __post_init__(self) -> None:
        self.check_level_order("tcq")

    @functools.cached_property
    def file_bytes(self) -> bytes:
        arrays, shapes = pack_arrays(self, _ARRAYS)
        payload = (
            arrays
            + np.ascontiguousarray(self.freq, dtype="<u2").tobytes()
            + np.ascontiguousarray(self.family, dtype="<u4").tobytes()
        )
        if self.predicted:
            payload += np.ascontiguousarray(self.predictor, dtype="<f2").tobytes()
            payload += np.ascontiguousarray(self.predictor_shift, dtype="u1").tobytes()
            payload += np.ascontiguousarray(self.residual_freq, dtype="<u2").tobytes()
        levels = {str(k): list(v) for k, v in self.levels.items()}
        version = 3 if self.predicted else 2 if self.adaptive else 1
        header = self.file_header(SCHEMA, version, levels, shapes)
        header["freq_entries"] = int(self.freq.size)
        if self.adaptive:
            header["family"] = list(self.family.shape)
        if self.predicted:
            header["predictor"] = list(self.predictor.shape)
            header["residual_freq_entries"] = int(self.residual_freq.size)
        return pack_model_file(MAGIC, header, payload)

    @property
    def adaptive(self) -> bool:
        """Whether its frames carry per-component offsets and table choices."""
        return len(self.family) > 0

    @property
    def predicted(self) -> bool:
        """Whether its coded frames predict each layer's symbols from the layer before."""
        return self.predictor.size > 0

    def table_bytes(self, level: int) -> int:
        """Bytes of ``level``'s frequency tables in the file (u16 per entry)."""
        return 2 * int(table_sizes(self.radius[self.level_index(level)]).sum())

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TcqModel) and other.id == self.id


def table_sizes(radius: np.ndarray) -> np.ndarray:
    """Entries of each component's table (``2 * radius + 1``; 0: dropped), int64."""
    return np.where(radius > 0, 2 * radius.astype(np.int64) + 1, 0)


def table_offsets(radius: np.ndarray) -> np.ndarray:
    """Start of each component's table in ``freq`` (radius [levels, L, 2, C]; -1: dropped)."""
    sizes = table_sizes(radius).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.where(sizes > 0, starts, -1).reshape(radius.shape)


def residual_targets(tcq: TcqModel, index: int, layer: int, kind: int) -> np.ndarray:
    """The components (increasing) of (``layer``, ``kind``) whose coded symbols are residuals
    at level ``index``: the kept ones below the predictor's targets, if the layer is
    predicted there."""
    if not tcq.predicted or not tcq.predictor_shift[index, layer]:
        return np.zeros(0, dtype=np.int64)
    kept = np.flatnonzero(tcq.radius[index, layer, kind])
    return kept[kept < tcq.predictor.shape[3]]


def residual_table_offsets(tcq: TcqModel) -> dict[tuple[int, int, int], int]:
    """Where the residual tables of (level index, layer, K/V) start in ``residual_freq``: for
    every level, predicted layer and K/V in order, one table of ``2 r + 1`` entries per
    :func:`residual_targets` component."""
    starts, at = {}, 0
    levels, layers = tcq.predictor_shift.shape if tcq.predicted else (0, 0)
    for x in range(levels):
        for layer in range(layers):
            for k in (0, 1):
                targets = residual_targets(tcq, x, layer, k)
                if len(targets):
                    starts[x, layer, k] = at
                    at += int(table_sizes(tcq.radius[x, layer, k][targets]).sum())
    return starts


def parse_tcq_model(data: bytes, where: str, model_id: str | None = None) -> TcqModel:
    """Read and fully validate a tcq model file (``model_id``: its content hash must match)."""
    return parse_model_file(data, where, model_id, "tcq model", _parse)


def _parse(data: bytes) -> TcqModel:
    header, payload = unpack_model_file(data, MAGIC, SCHEMA, (1, 2, VERSION))
    model = ModelIdentity.from_dict(header["model"])
    levels = {
        int(k): (float(v[0]), float(v[1]))
        for k, v in sorted(header["levels"].items(), key=lambda kv: int(kv[0]))
    }
    if any(not (s > 0) for steps in levels.values() for s in steps):
        raise ValueError("level steps must be positive")
    arrays, pos = read_arrays(header, payload, _ARRAYS, model, len(levels))
    radius = arrays["radius"]
    entries = int(table_sizes(radius).sum())
    family_shape = header["family"] if header["version"] > 1 else [0, MAX_RADIUS + 1]
    if len(family_shape) != 2 or family_shape[1] != MAX_RADIUS + 1:
        raise ValueError(f"family has shape {family_shape}, expected [tables, {MAX_RADIUS + 1}]")
    family_bytes = 4 * int(np.prod(family_shape))
    predictor_shape = _predictor_shape(header, model, len(levels))
    predictor_bytes = 2 * int(np.prod(predictor_shape))
    shift_bytes = len(levels) * model.num_layers if predictor_bytes else 0
    residual_entries = int(header["residual_freq_entries"]) if predictor_bytes else 0
    extra = 2 * entries + family_bytes + predictor_bytes + shift_bytes + 2 * residual_entries
    if int(header["freq_entries"]) != entries or pos + extra != len(payload):
        raise ValueError("frequency tables do not match the radii")
    freq = np.frombuffer(payload, dtype="<u2", count=entries, offset=pos).copy()
    pos += 2 * entries
    family = np.frombuffer(payload, dtype="<u4", count=family_bytes // 4, offset=pos)
    family = family.astype(np.uint32).reshape(-1, MAX_RADIUS + 1)
    pos += family_bytes
    predictor = np.frombuffer(payload, dtype="<f2", count=predictor_bytes // 2, offset=pos)
    predictor = predictor.astype(np.float16).reshape(predictor_shape)
    pos += predictor_bytes
    shift = np.frombuffer(payload, dtype="u1", count=shift_bytes, offset=pos).copy()
    shift = shift.reshape(len(levels), -1) if shift_bytes else np.zeros((0, 0), np.uint8)
    residual = np.frombuffer(payload, dtype="<u2", offset=pos + shift_bytes).astype(np.uint16)
    _check_tables(radius, freq)
    if header["version"] > 1 and not (0 < len(family) < 256 and np.all(family[:, 0] > 0)):
        raise ValueError("the table family must have 1 to 255 tables, each with a centre")
    if not np.all(np.isfinite(predictor)) or np.any(shift > MAX_PREDICTOR_SHIFT):
        raise ValueError("the predictor must be finite and its shifts at most 24")
    for name in ("weights", "steps"):
        if not np.all(np.isfinite(arrays[name])) or np.any(arrays[name] <= 0):
            raise ValueError(f"component {name} must be positive")
    thetas = read_rope_thetas(header, model)
    model_file = TcqModel(
        model,
        dict(header["calibration"]),
        thetas,
        levels,
        **arrays,
        freq=freq,
        family=family,
        predictor=predictor,
        predictor_shift=shift,
        residual_freq=residual,
    )
    _check_residual_tables(model_file)
    return model_file


def _predictor_shape(header: dict, model: ModelIdentity, levels: int) -> list[int]:
    """The predictor's shape: ``[L, 2, 2C, T]`` (1 <= T <= C) in a version-3 file, which has a
    family too; empty before."""
    if header["version"] < 3:
        return [0, 2, 0, 0]
    L, C = model.num_layers, model.num_kv_heads * model.head_dim
    shape = header["predictor"]
    if "family" not in header or len(shape) != 4 or shape[:3] != [L, 2, 2 * C]:
        raise ValueError(f"predictor has shape {shape}, expected [{L}, 2, {2 * C}, targets]")
    if not 1 <= shape[3] <= C:
        raise ValueError(f"the predictor's targets must be 1 to {C}, got {shape[3]}")
    return shape


def _check_residual_tables(tcq: TcqModel) -> None:
    """``ValueError`` unless ``residual_freq`` holds exactly the residual tables the shifts
    and radii imply, each summing to the rANS scale with no zero entry."""
    starts = residual_table_offsets(tcq)
    sizes = [
        table_sizes(tcq.radius[x, layer, k][residual_targets(tcq, x, layer, k)])
        for x, layer, k in starts
    ]
    if sum(int(size.sum()) for size in sizes) != tcq.residual_freq.size:
        raise ValueError("the residual tables do not match the predicted layers' radii")
    ends = np.cumsum(np.concatenate([np.zeros(0, np.int64), *sizes]))
    if np.any(tcq.residual_freq == 0) or np.any(
        np.diff(np.concatenate([[0], np.cumsum(tcq.residual_freq.astype(np.int64))[ends - 1]]))
        != rans.PROB_SCALE
    ):
        raise ValueError(f"a residual table does not sum to {rans.PROB_SCALE}")


def _check_tables(radius: np.ndarray, freq: np.ndarray) -> None:
    if radius.size and int(radius.max()) > MAX_RADIUS:
        raise ValueError(f"radii above {MAX_RADIUS}")
    starts = table_offsets(radius).reshape(-1)
    keep = table_sizes(radius).reshape(-1) > 0
    if np.any(freq == 0):
        raise ValueError("a frequency table has a zero entry")
    sums = np.add.reduceat(freq.astype(np.int64), starts[keep]) if keep.any() else np.zeros(0)
    if np.any(sums != rans.PROB_SCALE):
        raise ValueError(f"a frequency table does not sum to {rans.PROB_SCALE}")


TCQ_MODELS = ModelFiles(
    "tcq model",
    ".cgtq",
    parse_tcq_model,
    "cachegen.fitting.tcq.ensure_tcq_model, any `cachegen eval --codec tcq`",
    SHIPPED_DIR,
)
tcq_model_path, save_tcq_model, find_tcq_model, shipped_tcq_model = (
    TCQ_MODELS.path,
    TCQ_MODELS.save,
    TCQ_MODELS.find,
    TCQ_MODELS.shipped_for,
)
forget_cached_tcq_models = TCQ_MODELS.forget


TCQ_REF = ModelFileRef(
    "tcq model",
    "tcq",
    (REF_SCHEMA, REF_VERSION),
    "model_file",
    "cachegen.fitting.tcq.ensure_tcq_model",
    TCQ_MODELS,
)
tcq_ref_path, read_tcq_ref, write_tcq_ref = TCQ_REF.path, TCQ_REF.read, TCQ_REF.write
load_tcq_model = TCQ_REF.load
