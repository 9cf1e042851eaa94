"""Transform coding with entropy-coded uniform quantizers: the ``tcq`` codec.

Per layer, keys (turned back to their pre-RoPE form) and values each go through a PCA basis
over all heads' channels together, like ``kvtc``; unlike ``kvtc``, every component is coded by
a *uniform* quantizer whose symbols go through the project's rANS coder
(:mod:`cachegen.codec.rans`) with one calibrated frequency table per component. Component
``i`` of a (layer, K/V) has the step ``step / sqrt(w_i)``, where ``w_i`` is its weight in an
output-tracking distortion (keys: the component's mean squared effect on the attention logits
of the queries that read it; values: its gain through the output projection), so a level is
one step for the keys and one for the values: reverse water-filling. A component whose
calibration coefficients stay within a fraction of its step is dropped (costs nothing); the
others get an alphabet ``[-r_i, r_i]`` (``r_i`` from the calibration range, values beyond are
clipped) and a frequency table from the calibration histogram.

Text unlike the calibration text shifts the components' means and widens or narrows their
spreads, and calibrated tables then cost more than the symbols' entropy. So each frame also
chooses, per kept component, an *offset* (the median of its coefficients in quarter steps:
the quantizer's grid moves with it) and a *table*: the calibrated one or one of a fixed
family of discretized generalized-Gaussian shapes (``family`` in the model file), whichever
codes the frame's symbols in the fewest bits. The choices travel DEFLATE-compressed.

Everything the decoder shares with the encoder (basis, weights, steps, radii, tables) is one
file, a :class:`TcqModel` (``profiles/transforms/<id>.cgtq``; built from the model only by
``cachegen.profiles.ensure_tcq_model``), named by its content hash in the bitstream's
header (16 bytes; a 17th byte ``ADAPTIVE_LAYOUT`` marks frames with choices, format
version 5). Frame body::

    exact      tokens at positions below EXACT_TOKENS: keys then values [L, H, e, D] in the
               KV's dtype (empty in most frames)
    choices    (adaptive frames only) u32 byte count, then DEFLATE (zlib) of: every stream's
               kept components' offsets (i8, quarter steps), then their tables (u8: 0 the
               calibrated table, 1 + j family shape j), streams ordered (layer, K/V); no
               bytes at all when the frame has no token past the exact ones
    directory  u32 word count of each rANS stream, streams ordered (layer, K/V)
    streams    little-endian u16 words (layout in rans.py): stream (l, K/V) codes the symbols
               [kept components, tokens - e] of its kept components (a stream with no kept
               component or no token has no words)

A model file without a family (format version 1, written before the choices) encodes and
decodes frames without them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from cachegen import models
from cachegen.codec import rans, tcq_kernels
from cachegen.codec.base import Codec, FrameDecoder, kv_tensor
from cachegen.codec.bitstream import Frame, Header
from cachegen.codec.errors import CodecError
from cachegen.codec.parallel import run_batches
from cachegen.codec.profile import profile_path
from cachegen.codec.quant import rotary_cos_sin, rotate_layer_keys
from cachegen.codec.tcq_levels import read_tcq_levels
from cachegen.codec.transform import (
    ModelFiles,
    inflate_exactly,
    pack_model_file,
    parse_model_file,
    unpack_model_file,
)
from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen.kv import KVCache, ModelIdentity

EXACT_TOKENS = 1
MODEL_ID_BYTES = 16
MAX_RADIUS = (rans.MAX_ALPHABET - 1) // 2
MAGIC = b"CGTQ"
SCHEMA = "cachegen-tcq-model"
VERSION = 2  # 2 added the table family; 1 files still read (and write back byte for byte)
ADAPTIVE_LAYOUT = 1  # the header parameters' 17th byte: frames carry per-component choices
ADAPTIVE_BITSTREAM_VERSION = 5  # the bitstream format version that holds that byte
# The table family: discretized exp(-(|s| / scale) ** shape), for each shape every scale
# (in steps) of a geometric grid; each table is truncated to its component's radius.
FAMILY_SHAPES = (0.6, 0.8, 1.0, 1.4)
FAMILY_SCALES = 16
FAMILY_SCALE_RANGE = (0.08, 24.0)
OFFSET_UNITS = 4  # offsets are in 1 / OFFSET_UNITS of a step
ZLIB_LEVEL = 6  # the choices' DEFLATE level (zlib's default)
# code length in bits of a symbol of frequency f (0 for f = 0: no symbol there to count)
_CODE_BITS = np.concatenate([[0.0], -np.log2(np.arange(1, rans.PROB_SCALE + 1) / rans.PROB_SCALE)])
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


_KEPT_LAYER_SETS = 4  # decoding tables per level: the whole model and a few layer subsets


def _exact_count(start: int, num_tokens: int) -> int:
    return max(0, min(num_tokens, EXACT_TOKENS - start))


def family_weights() -> np.ndarray:
    """The family's one-sided integer weights [shapes * scales, MAX_RADIUS + 1] (uint32).
    They are computed once, at fitting time, and stored in the model file: the decoder
    derives its tables from these integers only, so it never depends on a machine's ``exp``."""
    scales = np.exp(np.linspace(*np.log(FAMILY_SCALE_RANGE), FAMILY_SCALES))
    a = np.arange(MAX_RADIUS + 1, dtype=np.float64)
    rows = [np.exp(-((a / b) ** shape)) for shape in FAMILY_SHAPES for b in scales]
    return np.round(np.array(rows) * 2.0**30).astype(np.uint32)


def _family_tables(family: np.ndarray, r: int) -> np.ndarray:
    """The family's frequency tables [tables, 2r + 1] for radius ``r``."""
    counts = family[:, np.abs(np.arange(-r, r + 1))].astype(np.int64)
    return rans.quantize_frequencies(counts, np.full(len(family), 2 * r + 1))


@dataclass
class LevelCode:
    """One level's coding state, derived from a :class:`TcqModel`: per (layer, K/V) the kept
    components, their radii and steps; the rANS tables of all kept components."""

    kept: list[list[np.ndarray]]  # [L][2]: component indices
    radius: list[list[np.ndarray]]  # [L][2]: int64 radius of each kept component
    step: list[list[torch.Tensor]]  # [L][2]: float32 step of each kept component
    analysis: list[list[torch.Tensor]]  # [L][2]: kept components' rows over their steps
    synthesis: list[list[np.ndarray]]  # [L][2]: kept components' rows scaled by their steps
    table_base: np.ndarray  # [L, 2]: row of each stream's first table
    freq_cum: np.ndarray  # [tables, width] uint32
    slot_sym: np.ndarray  # [tables, PROB_SCALE] uint8
    family_row: np.ndarray  # [MAX_RADIUS + 1]: row of radius r's first family table, or -1
    family_size: int  # tables of the family (0: the model file has none)
    decoding: dict = field(default_factory=dict, repr=False, compare=False)  # layers -> tables

    @functools.cached_property
    def code_bits(self) -> np.ndarray:
        """[tables, width] float64: the code length of each table's symbols (the encoder's
        table choice; decoders never need it)."""
        return _CODE_BITS[self.freq_cum >> 16]

    def stream_tables(self, tcq: TcqModel, layers: tuple[int, ...]) -> StreamTables:
        """The decoder's per-stream arrays for ``layers``, kept for the last few layer sets."""
        if layers not in self.decoding:
            while len(self.decoding) >= _KEPT_LAYER_SETS:
                self.decoding.pop(next(iter(self.decoding)))
            self.decoding[layers] = _stream_tables(tcq, self, layers)
        return self.decoding[layers]


@dataclass
class StreamTables:
    """A level's decoding state for a set of layers, one entry per (layer, K/V) stream in
    stream order: kept component counts, first table rows, the kept radii (float32, one
    stream after another from ``radius_off``), channel means [streams, channels] and the
    synthesis matrices [streams, width, channels] (kept components' rows scaled by their
    steps, zero rows up to ``width``, the largest kept count), in float32 and bfloat16."""

    kept: np.ndarray
    table_base: np.ndarray
    table_row: np.ndarray  # calibrated table row of every kept component, from radius_off
    slot: np.ndarray  # each kept component's flat index in [streams, width]
    radius_int: np.ndarray
    radius: np.ndarray
    radius_off: np.ndarray
    mean: np.ndarray
    synthesis: torch.Tensor
    synthesis_bf16: torch.Tensor

    @property
    def width(self) -> int:
        return self.synthesis.shape[1]


def _stream_tables(tcq: TcqModel, code: LevelCode, layers: tuple[int, ...]) -> StreamTables:
    pairs = [(layer, k) for layer in layers for k in (0, 1)]
    kept = np.array([len(code.kept[layer][k]) for layer, k in pairs], dtype=np.int64)
    channels = tcq.mean.shape[-1]
    width = max(1, int(kept.max(initial=0)))
    synthesis = torch.zeros((len(pairs), width, channels))
    for s, (layer, k) in enumerate(pairs):
        synthesis[s, : kept[s]] = torch.from_numpy(code.synthesis[layer][k])
    radius = np.concatenate([code.radius[layer][k] for layer, k in pairs])
    table_base = np.array([code.table_base[layer, k] for layer, k in pairs], dtype=np.int64)
    return StreamTables(
        kept=kept,
        table_base=table_base,
        table_row=np.concatenate([b + np.arange(c) for b, c in zip(table_base, kept)]).astype(
            np.int64
        ),
        slot=np.concatenate([s * width + np.arange(c) for s, c in enumerate(kept)]).astype(
            np.int64
        ),
        radius_int=radius.astype(np.int64),
        radius=radius.astype(np.float32),
        radius_off=np.concatenate([[0], np.cumsum(kept)[:-1]]).astype(np.int64),
        mean=np.ascontiguousarray(tcq.mean[list(layers)].reshape(len(pairs), channels)),
        synthesis=synthesis,
        synthesis_bf16=synthesis.to(torch.bfloat16),
    )


@functools.cache
def bf16_synthesis() -> bool:
    """Whether bfloat16 output is synthesized by a bfloat16 GEMM: on CPUs with bfloat16
    matrix instructions (AMX or AVX512-BF16), where it runs several times faster than
    float32 and rounds the synthesis entries and the product to bfloat16, far below the
    quantizer's error (docs/codec.md, tcq's "Decode speed"). Elsewhere bfloat16 GEMMs are
    emulated and slower, so the synthesis stays float32. (torch names these CPU probes with
    a leading underscore; a torch without them reads as neither.)"""
    cpu = torch.cpu
    return any(
        bool(getattr(cpu, probe, lambda: False)())
        for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    )


@dataclass
class TcqModel:
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

    def __post_init__(self) -> None:
        if list(self.levels) != sorted(self.levels):
            raise CodecError(f"tcq levels must be in increasing order, got {list(self.levels)}")

    @functools.cached_property
    def file_bytes(self) -> bytes:
        arrays = {name: getattr(self, name) for name in _ARRAYS}
        payload = (
            b"".join(
                np.ascontiguousarray(arrays[name], dtype=_ARRAYS[name][0]).tobytes()
                for name in _ARRAYS
            )
            + np.ascontiguousarray(self.freq, dtype="<u2").tobytes()
            + np.ascontiguousarray(self.family, dtype="<u4").tobytes()
        )
        header = {
            "schema": SCHEMA,
            "version": VERSION if self.adaptive else 1,
            "model": self.model.to_dict(),
            "calibration": self.calibration,
            "rope_thetas": list(self.rope_thetas),
            "levels": {str(k): list(v) for k, v in self.levels.items()},
            "arrays": {name: list(arrays[name].shape) for name in _ARRAYS},
            "freq_entries": int(self.freq.size),
        }
        if self.adaptive:
            header["family"] = list(self.family.shape)
        return pack_model_file(MAGIC, header, payload)

    @property
    def adaptive(self) -> bool:
        """Whether its frames carry per-component offsets and table choices."""
        return len(self.family) > 0

    @functools.cached_property
    def id(self) -> str:
        return hashlib.sha256(self.file_bytes).hexdigest()[:32]

    @property
    def nbytes(self) -> int:
        return len(self.file_bytes)

    def table_bytes(self, level: int) -> int:
        """Bytes of ``level``'s frequency tables in the file (u16 per entry)."""
        radius = self.radius[self._index(level)].astype(np.int64)
        return int(2 * np.sum(np.where(radius > 0, 2 * radius + 1, 0)))

    def _index(self, level: int) -> int:
        if level not in self.levels:
            raise CodecError(
                f"the tcq model {self.id[:16]} of {self.model.name} has no level {level}; "
                f"levels are {sorted(self.levels)}"
            )
        return list(self.levels).index(level)

    def level_code(self, level: int) -> LevelCode:
        return _level_code(self, self._index(level))

    def check_model(self, model: ModelIdentity) -> None:
        """``CodecError`` unless this model file was fitted for ``model``."""
        mine = self.model
        if (mine.fingerprint, mine.num_layers, mine.num_kv_heads, mine.head_dim) != (
            model.fingerprint,
            model.num_layers,
            model.num_kv_heads,
            model.head_dim,
        ):
            raise CodecError(
                f"the tcq model {self.id[:16]} was fitted for model {mine.name} "
                f"({mine.fingerprint[:12]}), not {model.name} ({model.fingerprint[:12]}); "
                f"fit one for {model.name} (cachegen.profiles.ensure_tcq_model)"
            )

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TcqModel) and other.id == self.id


def _table_offsets(radius: np.ndarray) -> np.ndarray:
    """Start of each component's table in ``freq`` (radius [levels, L, 2, C]; -1: dropped)."""
    sizes = np.where(radius > 0, 2 * radius.astype(np.int64) + 1, 0).reshape(-1)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    return np.where(sizes > 0, starts, -1).reshape(radius.shape)


@functools.lru_cache(maxsize=8)
def _level_code(tcq: TcqModel, index: int) -> LevelCode:
    radius = tcq.radius[index].astype(np.int64)
    starts = _table_offsets(tcq.radius)[index]
    L, _, C = radius.shape
    width = max(3, 2 * int(radius.max()) + 1)
    kept, radii, steps, analysis, synthesis, rows = [], [], [], [], [], []
    base = np.zeros((L, 2), dtype=np.int64)
    count = 0
    for layer in range(L):
        kept.append([]), radii.append([]), steps.append([])
        analysis.append([]), synthesis.append([])
        for k in range(2):
            idx = np.flatnonzero(radius[layer, k])
            kept[layer].append(idx)
            radii[layer].append(radius[layer, k][idx])
            step = tcq.steps[index, layer, k][idx]
            steps[layer].append(torch.from_numpy(step.copy()))
            rows_over_steps = tcq.components[layer, k][idx] / step[:, None]
            analysis[layer].append(torch.from_numpy(rows_over_steps.astype(np.float32)))
            scaled = step[:, None].astype(np.float32) * tcq.components[layer, k][idx]
            synthesis[layer].append(np.ascontiguousarray(scaled, dtype=np.float32))
            base[layer, k] = count
            count += len(idx)
            for i in idx:
                table = np.zeros(width, dtype=np.uint16)
                n = 2 * int(radius[layer, k, i]) + 1
                table[:n] = tcq.freq[starts[layer, k, i] : starts[layer, k, i] + n]
                rows.append(table)
    family_row = np.full(MAX_RADIUS + 1, -1, dtype=np.int64)
    if tcq.adaptive:
        for r in np.unique(radius[radius > 0]):
            tables = _family_tables(tcq.family, int(r))
            family_row[r] = len(rows)
            for table in tables:
                rows.append(np.pad(table, (0, width - len(table))).astype(np.uint16))
    freq = np.stack(rows) if rows else np.zeros((1, width), dtype=np.uint16)
    slot = rans.slot_table(freq) if rows else np.zeros((1, rans.PROB_SCALE), np.uint8)
    return LevelCode(
        kept,
        radii,
        steps,
        analysis,
        synthesis,
        base,
        rans.pack_freq_cum(freq),
        slot,
        family_row,
        len(tcq.family),
    )


# ---- the model file -------------------------------------------------------------------------


def parse_tcq_model(data: bytes, where: str, model_id: str | None = None) -> TcqModel:
    """Read and fully validate a tcq model file (``model_id``: its content hash must match)."""
    return parse_model_file(data, where, model_id, "tcq model", _parse)


def _parse(data: bytes) -> TcqModel:
    header, payload = unpack_model_file(data, MAGIC, SCHEMA, (1, VERSION))
    model = ModelIdentity.from_dict(header["model"])
    levels = {
        int(k): (float(v[0]), float(v[1]))
        for k, v in sorted(header["levels"].items(), key=lambda kv: int(kv[0]))
    }
    if any(not (s > 0) for steps in levels.values() for s in steps):
        raise ValueError("level steps must be positive")
    L, C = model.num_layers, model.num_kv_heads * model.head_dim
    arrays, pos = {}, 0
    for name, (dtype, shape_of) in _ARRAYS.items():
        shape = shape_of(L, C, len(levels))
        if list(shape) != header["arrays"][name]:
            raise ValueError(f"{name} has shape {header['arrays'][name]}, expected {list(shape)}")
        count = int(np.prod(shape))
        size = count * np.dtype(dtype).itemsize
        if pos + size > len(payload):
            raise ValueError("arrays are truncated")
        arrays[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=pos)
        arrays[name] = arrays[name].reshape(shape).copy()
        pos += size
    radius = arrays["radius"]
    entries = int(np.sum(np.where(radius > 0, 2 * radius.astype(np.int64) + 1, 0)))
    family_shape = header["family"] if header["version"] > 1 else [0, MAX_RADIUS + 1]
    if len(family_shape) != 2 or family_shape[1] != MAX_RADIUS + 1:
        raise ValueError(f"family has shape {family_shape}, expected [tables, {MAX_RADIUS + 1}]")
    family_bytes = 4 * int(np.prod(family_shape))
    if int(header["freq_entries"]) != entries or pos + 2 * entries + family_bytes != len(payload):
        raise ValueError("frequency tables do not match the radii")
    freq = np.frombuffer(payload, dtype="<u2", count=entries, offset=pos).copy()
    family = np.frombuffer(payload, dtype="<u4", offset=pos + 2 * entries).astype(np.uint32)
    family = family.reshape(-1, MAX_RADIUS + 1)
    _check_tables(radius, freq)
    if header["version"] > 1 and not (0 < len(family) < 256 and np.all(family[:, 0] > 0)):
        raise ValueError("the table family must have 1 to 255 tables, each with a centre")
    for name in ("weights", "steps"):
        if not np.all(np.isfinite(arrays[name])) or np.any(arrays[name] <= 0):
            raise ValueError(f"component {name} must be positive")
    thetas = tuple(float(t) for t in header["rope_thetas"])
    if len(thetas) != L:
        raise ValueError("rope_thetas does not have one base per layer")
    return TcqModel(
        model, dict(header["calibration"]), thetas, levels, **arrays, freq=freq, family=family
    )


def _check_tables(radius: np.ndarray, freq: np.ndarray) -> None:
    if radius.size and int(radius.max()) > MAX_RADIUS:
        raise ValueError(f"radii above {MAX_RADIUS}")
    starts = _table_offsets(radius).reshape(-1)
    sizes = np.where(radius > 0, 2 * radius.astype(np.int64) + 1, 0).reshape(-1)
    keep = sizes > 0
    if np.any(freq == 0):
        raise ValueError("a frequency table has a zero entry")
    sums = np.add.reduceat(freq.astype(np.int64), starts[keep]) if keep.any() else np.zeros(0)
    if np.any(sums != rans.PROB_SCALE):
        raise ValueError(f"a frequency table does not sum to {rans.PROB_SCALE}")


TCQ_MODELS = ModelFiles(
    "tcq model",
    ".cgtq",
    parse_tcq_model,
    "cachegen.profiles.ensure_tcq_model, any `cachegen eval --codec tcq`",
)
tcq_model_path, save_tcq_model, find_tcq_model = (
    TCQ_MODELS.path,
    TCQ_MODELS.save,
    TCQ_MODELS.find,
)
forget_cached_tcq_models = TCQ_MODELS.forget


def tcq_ref_path(model: ModelIdentity):
    """Where the id of a model's tcq model is kept: next to its cachegen profile."""
    return profile_path(model).parent / "tcq.json"


def read_tcq_ref(model: ModelIdentity) -> dict | None:
    """``{"model_file": id, "calibration": ...}`` of the model's tcq model, or None."""
    path = tcq_ref_path(model)
    if not path.is_file():
        return None
    try:
        data = check_version(json.loads(path.read_text()), REF_SCHEMA, (REF_VERSION,), str(path))
        return {"model_file": str(data["model_file"]), "calibration": dict(data["calibration"])}
    except (OSError, ValueError, KeyError, TypeError, CacheGenError) as exc:
        raise CodecError(
            f"tcq model reference {path} is unreadable ({exc}); delete it and fit the model "
            "again (any `cachegen eval --codec tcq`)"
        ) from exc


def write_tcq_ref(tcq: TcqModel) -> None:
    data = versioned(
        REF_SCHEMA, REF_VERSION, {"model_file": tcq.id, "calibration": tcq.calibration}
    )
    write_atomic(tcq_ref_path(tcq.model), json.dumps(data, indent=1).encode() + b"\n")


def load_tcq_model(model: str | models.ModelSpec) -> TcqModel:
    """The stored tcq model of ``model``. Never fits one: ``CodecError`` says how."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    ref = read_tcq_ref(identity)
    if ref is None:
        raise CodecError(
            f"no tcq model for {spec.name} in {tcq_ref_path(identity).parent}; fit it with "
            f"cachegen.profiles.ensure_tcq_model (any `cachegen eval --codec tcq`)"
        )
    return find_tcq_model(ref["model_file"], identity)


# ---- quantizing -----------------------------------------------------------------------------


def quantize_rows(
    tcq: TcqModel,
    code: LevelCode,
    layer: int,
    kind: int,
    rows: torch.Tensor,
    centred: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Symbols ``[kept, tokens]`` (uint8) of ``rows`` [tokens, channels] (float32, pre-RoPE
    keys or values of layer ``layer``) and each kept component's offset (int8, in
    1 / OFFSET_UNITS steps: the median of its coefficients when ``centred``, else 0: the
    quantizer's grid moves with it)."""
    kept = code.kept[layer][kind]
    mean = torch.from_numpy(tcq.mean[layer, kind])
    y = (code.analysis[layer][kind] @ (rows - mean).T).numpy()  # [kept, tokens], in steps
    offset = np.zeros(len(kept), dtype=np.float32)
    if centred and y.shape[1]:
        middle = (y.shape[1] - 1) // 2  # the lower median, as torch.median takes it
        median = np.partition(y, middle, axis=1)[:, middle]
        offset = np.clip(np.round(median * OFFSET_UNITS), -127, 127)
        y -= (offset / OFFSET_UNITS)[:, None]
    radius = code.radius[layer][kind].astype(np.float32)[:, None]
    sym = np.clip(np.round(y), -radius, radius) + radius
    return sym.astype(np.uint8), offset.astype(np.int8)


def choose_tables(code: LevelCode, layer: int, kind: int, sym: np.ndarray) -> np.ndarray:
    """Each kept component's table (uint8: 0 its calibrated table, ``1 + j`` family table
    ``j``), the one that codes its symbols ``sym`` [kept, tokens] in the fewest bits (the
    first of the family's cheapest, and only where it is cheaper than the calibrated one)."""
    radius = code.radius[layer][kind]
    choice = np.zeros(len(radius), dtype=np.uint8)
    tcq_kernels.choose_tables(
        sym,
        radius,
        int(code.table_base[layer, kind]),
        code.family_row,
        code.family_size,
        code.code_bits,
        choice,
    )
    return choice


# ---- the codec ------------------------------------------------------------------------------


class TcqCodec(Codec):
    name = "tcq"
    codec_id = 12

    def __init__(
        self,
        model: models.ModelSpec | str | None = None,
        chunk_tokens: int = 256,
        tcq: TcqModel | None = None,
    ) -> None:
        super().__init__(chunk_tokens)
        if tcq is None and model is not None:
            tcq = load_tcq_model(model)
        self._tcq = tcq

    @property
    def tcq(self) -> TcqModel:
        if self._tcq is None:
            raise CodecError(
                "the tcq codec needs a model for its basis: get_codec('tcq', model=NAME)"
            )
        return self._tcq

    @property
    def levels(self) -> list[int]:
        return sorted(self.tcq.levels)

    def calibrated_levels(self) -> dict | None:
        """The quality targets its levels met and the default level, as ``cachegen calibrate
        --codec tcq`` chose them for this model file or shipped them for its recipe
        (``cachegen.codec.tcq_levels``); None if never calibrated."""
        return read_tcq_levels(self.tcq.model, self.tcq.id, self.tcq.calibration)

    @property
    def default_level(self) -> int:
        """The calibrated default level (:meth:`calibrated_levels`), else the middle one."""
        calibrated = self.calibrated_levels()
        if calibrated and calibrated["default_level"] is not None:
            return calibrated["default_level"]
        return self.levels[len(self.levels) // 2]

    @property
    def profile_id(self) -> str:
        return self.tcq.id

    def __repr__(self) -> str:
        model = self._tcq.model.name if self._tcq else None
        return f"TcqCodec(model={model!r}, chunk_tokens={self.chunk_tokens})"

    def encode(self, kv: KVCache, level: int | None = None) -> bytes:
        if self._tcq is None:
            self._tcq = load_tcq_model(kv.model.name)
        self.tcq.check_model(kv.model)
        return super().encode(kv, level)

    def params(self, kv: KVCache, level: int) -> bytes:
        layout = bytes([ADAPTIVE_LAYOUT]) if self.tcq.adaptive else b""
        return bytes.fromhex(self.tcq.id) + layout

    def bitstream_version(self, level: int) -> int:
        return ADAPTIVE_BITSTREAM_VERSION if self.tcq.adaptive else 1

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        tcq, code = self.tcq, self.tcq.level_code(level)
        layers = list(chunk.layer_indices)
        e = _exact_count(chunk.start, chunk.num_tokens)
        x = kv_tensor(chunk)
        exact = x[:, :, :, :e].contiguous().view(torch.uint8).numpy().tobytes()
        q = x[:, :, :, e:].to(torch.float32)
        thetas = tuple(tcq.rope_thetas[i] for i in layers)
        if any(thetas):
            q[0] = rotate_layer_keys(q[0], chunk.start + e, thetas, inverse=True)
        L, H, m, D = q.shape[1:]
        streams: list[np.ndarray] = [np.zeros(0, dtype=np.uint16)] * (2 * L)
        none = np.zeros(0, dtype=np.uint8)
        offsets, choices = [none] * (2 * L), [none] * (2 * L)

        def kernel(todo: np.ndarray) -> None:
            for s in todo:
                i, k = divmod(int(s), 2)
                layer = layers[i]
                kept = len(code.kept[layer][k])
                if not kept or not m:
                    continue
                rows = q[k, i].permute(1, 0, 2).reshape(m, H * D)
                sym, offset = quantize_rows(tcq, code, layer, k, rows, centred=tcq.adaptive)
                table_row = int(code.table_base[layer, k]) + np.arange(kept)
                if tcq.adaptive:
                    choice = choose_tables(code, layer, k, sym)
                    table_row = _table_rows(code, code.radius[layer][k], choice, table_row)
                    offsets[s], choices[s] = offset.view(np.uint8), choice
                streams[s] = _rans_encode(sym, table_row, code.freq_cum)

        run_batches(
            kernel, np.array([len(code.kept[lay][k]) + 1 for lay in layers for k in (0, 1)])
        )
        lengths = np.array([len(w) for w in streams], dtype="<u4")
        side = b""
        if tcq.adaptive and m:
            packed = zlib.compress(np.concatenate(offsets + choices).tobytes(), ZLIB_LEVEL)
            side = np.array([len(packed)], dtype="<u4").tobytes() + packed
        return exact + side + lengths.tobytes() + np.concatenate(streams).astype("<u2").tobytes()

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        params = header.params
        adaptive = len(params) == MODEL_ID_BYTES + 1
        if not (len(params) == MODEL_ID_BYTES or adaptive):
            raise CodecError("tcq bitstream header is corrupt (parameters)")
        if adaptive and (
            params[-1] != ADAPTIVE_LAYOUT or header.version < ADAPTIVE_BITSTREAM_VERSION
        ):
            raise CodecError("tcq bitstream header is corrupt (frame layout)")
        tcq = find_tcq_model(params[:MODEL_ID_BYTES].hex(), header.model)
        if adaptive and not tcq.adaptive:
            raise CodecError(
                f"tcq bitstream is corrupt: its frames choose tables, but its model file "
                f"{tcq.id[:16]} has no table family"
            )
        return TcqDecoder(header, tcq, tcq.level_code(header.level), adaptive)


def _table_rows(
    code: LevelCode, radius: np.ndarray, choice: np.ndarray, calibrated: np.ndarray
) -> np.ndarray:
    """Table rows of components with ``radius`` and ``choice`` (0: their ``calibrated`` rows)."""
    family = code.family_row[radius.astype(np.int64)] + choice.astype(np.int64) - 1
    return np.where(choice == 0, calibrated, family)


def _rans_encode(sym: np.ndarray, table_row: np.ndarray, freq_cum: np.ndarray) -> np.ndarray:
    """rANS words of symbols ``sym`` [kept, tokens], component ``c`` coded with table row
    ``table_row[c]``."""
    C, n = sym.shape
    view = np.ascontiguousarray(sym.T).reshape(1, 1, n, C)
    out_off = np.array([0, C * n + rans.STATE_WORDS], dtype=np.int64)
    out = np.empty(int(out_off[-1]), dtype=np.uint16)
    start = np.empty(1, dtype=np.int64)
    rans.encode_layers(
        view,
        np.zeros(1, np.int64),
        np.ascontiguousarray(freq_cum[table_row]),
        out,
        out_off,
        np.zeros(1, np.int64),
        start,
    )
    return out[int(start[0]) :]


@dataclass
class _Layout:
    """Where a frame body's parts are: exact tokens, choices (adaptive frames), streams."""

    exact_tokens: int
    exact_bytes: int
    side_bytes: int  # the choices' bytes, their length word included
    words: np.ndarray  # word count of each stream
    offsets: np.ndarray | None = None  # int8 per kept component (adaptive frames)
    choices: np.ndarray | None = None  # uint8 per kept component (adaptive frames)


class TcqDecoder(FrameDecoder):
    def __init__(self, header: Header, tcq: TcqModel, code: LevelCode, adaptive: bool) -> None:
        super().__init__(header)
        self.tcq = tcq
        self.code = code
        self.adaptive = adaptive
        self.layers = list(header.layer_indices)
        self.streams = code.stream_tables(tcq, tuple(self.layers))
        self.thetas = [tcq.rope_thetas[layer] for layer in self.layers]
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        self._checked: dict[int, tuple[object, _Layout]] = {}  # frame index -> (body, layout)

    def _scratch_for(self, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients [streams, tokens, width] and rows [streams, tokens, channels] of the
        synthesis's ``dtype``, kept for the next frame of the same length: fresh pages cost
        as much as filling them."""
        scratch = self._scratch
        if scratch is None or scratch[0].shape[1] != tokens or scratch[0].dtype != dtype:
            streams, channels = self.streams, self.streams.synthesis.shape[2]
            count = len(streams.kept)
            self._scratch = (
                torch.empty((count, tokens, streams.width), dtype=dtype),
                torch.empty((count, tokens, channels), dtype=dtype),
            )
        return self._scratch

    def _frame_start(self, frame: Frame) -> int:
        return self.header.start + frame.index * self.header.chunk_tokens

    def _choices(self, frame: Frame, at: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(bytes, offsets, table choices) of an adaptive frame's choices at byte ``at``."""
        body, where = frame.body, f"frame {frame.index} is corrupt: tcq"
        if len(body) < at + 4:
            raise CodecError(f"{where} body is {len(body)} bytes, too short for its choices")
        (size,) = np.frombuffer(body, dtype="<u4", count=1, offset=at)
        if at + 4 + int(size) > len(body):
            raise CodecError(f"{where} choices run past the body")
        kept = int(self.streams.kept.sum())
        raw = inflate_exactly(
            body[at + 4 : at + 4 + int(size)],
            2 * kept,
            f"{where} choices do not inflate",
            f"{where} choices are not one entry per kept component",
        )
        offsets = np.frombuffer(raw, dtype=np.int8, count=kept)
        choices = np.frombuffer(raw, dtype=np.uint8, offset=kept)
        if int(choices.max(initial=0)) > len(self.tcq.family):
            raise CodecError(f"{where} choices name a table the family does not have")
        return 4 + int(size), offsets, choices

    def _layout(self, frame: Frame) -> _Layout:
        """Where the body's parts are, checked against the body."""
        h = self.header
        n = len(frame.token_ids)
        e = _exact_count(self._frame_start(frame), n)
        exact = 2 * h.num_layers * h.num_kv_heads * e * h.head_dim * h.dtype.itemsize
        side, offsets, choices = 0, None, None
        if self.adaptive and n > e:
            side, offsets, choices = self._choices(frame, exact)
        count = 2 * h.num_layers
        body = frame.body
        if len(body) < exact + side + 4 * count:
            raise CodecError(
                f"frame {frame.index} is corrupt: tcq body is {len(body)} bytes, too short for "
                f"its exact tokens and stream directory"
            )
        words = np.frombuffer(body, dtype="<u4", count=count, offset=exact + side)
        words = words.astype(np.int64)
        if exact + side + 4 * count + 2 * int(words.sum()) != len(body):
            raise CodecError(
                f"frame {frame.index} is corrupt: tcq stream sizes do not add up to the body"
            )
        for s, w in enumerate(words):
            layer, k = self.layers[s // 2], s % 2
            empty = not len(self.code.kept[layer][k]) or n == e
            if (w == 0) != empty or (not empty and w < rans.STATE_WORDS):
                raise CodecError(f"frame {frame.index} is corrupt: tcq stream {s} has {w} words")
        return _Layout(e, exact, side, words, offsets, choices)

    def check(self, frame: Frame) -> None:
        self._checked[frame.index] = (frame.body, self._layout(frame))

    def _checked_layout(self, frame: Frame) -> _Layout:
        """The layout :meth:`check` found for this frame (so its choices inflate once), else
        the frame's layout checked now."""
        body, layout = self._checked.pop(frame.index, (None, None))
        return layout if body is frame.body else self._layout(frame)

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        h = self.header
        n = len(frame.token_ids)
        layout = self._checked_layout(frame)
        e, exact, words = layout.exact_tokens, layout.exact_bytes, layout.words
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        if e:
            raw = torch.frombuffer(bytearray(frame.body[:exact]), dtype=torch.uint8)
            out[:, :, :, token_offset : token_offset + e] = raw.view(h.dtype).view(2, L, H, e, D)
        m = n - e
        if not m:
            return
        streams = self.streams
        table_row, mean = streams.table_row, streams.mean
        if layout.choices is not None:
            table_row = _table_rows(self.code, streams.radius_int, layout.choices, table_row)
            mean = self._centred_mean(layout.offsets)
        data = np.frombuffer(
            frame.body, dtype="<u2", offset=exact + layout.side_bytes + 4 * len(words)
        )
        word_off = np.concatenate([[0], np.cumsum(words)]).astype(np.int64)
        bf16 = out.dtype == torch.bfloat16 and bf16_synthesis()
        coefficients, rows = self._scratch_for(m, torch.bfloat16 if bf16 else torch.float32)
        coefficient_array = _numpy_of(coefficients).reshape(-1)
        status = np.zeros(2 * L, dtype=np.uint8)
        code = self.code

        def decode_kernel(todo: np.ndarray) -> None:
            tcq_kernels.decode_coefficients(
                data,
                word_off,
                streams.kept,
                table_row,
                streams.radius,
                streams.radius_off,
                code.slot_sym,
                code.freq_cum,
                coefficient_array,
                m,
                streams.width,
                todo,
                status,
            )

        run_batches(decode_kernel, words + streams.kept * m + 1)
        if status.any():
            raise CodecError(f"frame {frame.index} is corrupt: a tcq rANS stream does not decode")
        # one batched GEMM for all streams (torch's BLAS, in its own threads)
        torch.bmm(coefficients, streams.synthesis_bf16 if bf16 else streams.synthesis, out=rows)
        self._write(_numpy_of(rows), mean, self._frame_start(frame) + e, out, token_offset + e)

    def _centred_mean(self, offsets: np.ndarray) -> np.ndarray:
        """The channel means [streams, channels] moved by the frame's component offsets
        (their rows of the synthesis, which are already scaled by the steps)."""
        streams = self.streams
        moved = np.zeros((len(streams.kept), streams.width), dtype=np.float32)
        moved.reshape(-1)[streams.slot] = offsets
        shift = torch.bmm(torch.from_numpy(moved)[:, None], streams.synthesis)[:, 0]
        return streams.mean + shift.numpy() / OFFSET_UNITS

    def _write(
        self, rows: np.ndarray, mean: np.ndarray, start: int, out: torch.Tensor, offset: int
    ) -> None:
        """Rows [streams, m, channels] (float32 or bfloat16 bits) plus the channel means
        ``mean``, keys turned, into ``out`` from token ``offset`` (absolute position
        ``start``): bf16 or float32 in place, else through a float32 scratch."""
        h = self.header
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        m = rows.shape[1]
        direct = out.dtype in (torch.bfloat16, torch.float32) and out.is_contiguous()
        if direct:
            target, T, t0 = out, out.shape[3], offset
        else:
            target, T, t0 = torch.empty((2, L, H, m, D), dtype=torch.float32), m, 0
        flat = target.view(-1)
        bf16 = target.dtype == torch.bfloat16
        out16 = _numpy_of(flat) if bf16 else _NO_BF16
        out32 = _NO_F32 if bf16 else flat.numpy()
        thetas = sorted({t for t in self.thetas if t})
        cos_sin = [rotary_cos_sin(start, m, D, theta) for theta in thetas]
        cos = torch.cat([c for c, _ in cos_sin]).numpy() if thetas else _NO_ANGLES
        sin = torch.cat([s for _, s in cos_sin]).numpy() if thetas else _NO_ANGLES
        first_angle = np.array(
            [thetas.index(t) * m if t and k == 0 else -1 for t in self.thetas for k in (0, 1)],
            dtype=np.int64,
        )
        base = np.array(
            [((k * L + i) * H * T + t0) * D for i in range(L) for k in (0, 1)], dtype=np.int64
        )

        def write_kernel(todo: np.ndarray) -> None:
            tcq_kernels.write_rows(
                rows, mean, first_angle, cos, sin, H, D, out16, out32, base, T, todo
            )

        run_batches(write_kernel, np.ones(2 * L))
        if not direct:
            out[:, :, :, offset : offset + m] = target

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        layout = self._layout(frame)
        h, words = self.header, layout.words
        per_stream = 2 * words.astype(np.float64).reshape(h.num_layers, 2)
        shared = layout.exact_bytes + layout.side_bytes + 4 * len(words)
        return per_stream + shared / (2 * h.num_layers)


def _numpy_of(x: torch.Tensor) -> np.ndarray:
    """``x``'s memory as numpy: float32, or bfloat16 bits as uint16."""
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


_NO_BF16 = np.zeros(0, dtype=np.uint16)
_NO_F32 = np.zeros(0, dtype=np.float32)
_NO_ANGLES = np.zeros((0, 0), dtype=np.float32)
