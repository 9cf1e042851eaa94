"""Quantization schemes for the CacheGen codec: configuration, presets and the torch kernels.

A :class:`QuantConfig` says, for one quality level, how each layer's keys and values turn
into small integer symbols before entropy coding:

* ``key_bins`` / ``value_bins``: bins per layer, following the CacheGen implementation's
  convention: ``bins`` gives ``max_level = bins // 2 - 1`` and symmetric integer levels
  ``-max_level .. max_level`` (so an alphabet of ``2 * max_level + 1`` symbols, e.g. 31 for
  32 bins);
* ``key_scale`` / ``value_scale``: what one scale (the absolute maximum, stored as fp16)
  covers: ``"token"`` = one token of one layer across all heads (the paper),
  ``"token-head"`` = one token of one head, ``"channel"`` = one channel (head, dim) across
  the tokens of a chunk (what KIVI does for keys);
* ``hadamard``: rotate every head vector by an orthonormal Hadamard matrix before
  quantizing (and back after decoding), which spreads outlier channels;
* ``group_size``: CacheGen's token-wise locality. Tokens of a chunk form groups of
  ``group_size``; the first token of a group (the anchor) is quantized as is, the others as
  deltas against the *reconstructed* anchor (closed loop, so anchor error does not add up).
  0 turns it off;
* ``rope_theta``: keys are turned back by their rotary position angles (NeoX "rotate half"
  pairs, ``position * theta ** (-2i / head_dim)``) before quantizing and turned forward
  after decoding. A channel of pre-RoPE keys keeps one distribution across positions, so
  the per-channel tables code it in fewer bits (KVQuant makes the same observation). Any
  theta decodes to the right keys; only the model's own theta saves bits. 0 turns it off.
  One number for every layer, or one per layer for models whose layers use different bases
  (Gemma 3: 10,000 in sliding-window layers, 1,000,000 in full-attention layers); 0 in a
  layer leaves that layer's keys as they are;
* ``exact_tokens``: the first ``exact_tokens`` positions of a sequence are also stored
  exactly (the KV's own dtype). The first token is the attention sink: nearly every query
  attends to it, so its quantization error reaches every later token.

All kernels work on float32 torch tensors of shape ``[layers, heads, tokens, head_dim]``
and run unchanged on a GPU.
"""

from __future__ import annotations

import functools
import itertools
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import torch

from cachegen.codec.cachegen import kernels as qkernels
from cachegen.codec.coding.parallel import run_batches
from cachegen.codec.errors import CodecError
from cachegen.codec.transform.rotary import rotate_layer_keys

SCALE_KINDS = ("token", "token-head", "channel")
MIN_BINS = 4
MAX_BINS = 256  # 255 symbols: fits the coder's uint8 alphabet
FP16_MAX = 65504.0
_EXTENSION = struct.Struct("<fH")  # rope_theta, exact_tokens (see QuantConfig.pack)
_THETA_RUN = struct.Struct("<Hf")  # layers, rope base (per-layer bases, see QuantConfig.pack)
FLAG_EXTENDED = 1 << 5
FLAG_LAYER_THETAS = 1 << 6


def max_level(bins: int) -> int:
    """Largest quantized magnitude for ``bins`` (the CacheGen convention)."""
    return bins // 2 - 1


def alphabet_size(bins: int) -> int:
    return 2 * max_level(bins) + 1


@dataclass(frozen=True)
class QuantConfig:
    """How one quality level quantizes keys and values (see the module docstring)."""

    key_bins: tuple[int, ...]
    value_bins: tuple[int, ...]
    key_scale: str = "token"
    value_scale: str = "token"
    hadamard: bool = False
    group_size: int = 0
    rope_theta: float | tuple[float, ...] = 0.0
    exact_tokens: int = 0
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_bins", tuple(int(b) for b in self.key_bins))
        object.__setattr__(self, "value_bins", tuple(int(b) for b in self.value_bins))
        if not self.key_bins or len(self.key_bins) != len(self.value_bins):
            raise CodecError(
                "key_bins and value_bins need one entry per layer, the same number for both"
            )
        for bins in self.key_bins + self.value_bins:
            if not MIN_BINS <= bins <= MAX_BINS:
                raise CodecError(f"bins must be in [{MIN_BINS}, {MAX_BINS}], got {bins}")
        for kind in (self.key_scale, self.value_scale):
            if kind not in SCALE_KINDS:
                raise CodecError(
                    f"unknown scale granularity {kind!r}; use one of {', '.join(SCALE_KINDS)}"
                )
        if not 0 <= int(self.group_size) <= 65535 or self.group_size == 1:
            raise CodecError(f"group_size must be 0 (off) or 2..65535, got {self.group_size}")
        object.__setattr__(self, "rope_theta", self._normal_thetas(self.rope_theta))
        if not 0 <= int(self.exact_tokens) <= 65535:
            raise CodecError(f"exact_tokens must be in 0..65535, got {self.exact_tokens}")

    def _normal_thetas(self, theta) -> float | tuple[float, ...]:
        """float32 values (what the header stores, so a config compares equal after a round
        trip); per-layer bases that are all equal collapse to one number."""
        values = tuple(theta) if isinstance(theta, (tuple, list)) else (theta,)
        if isinstance(theta, (tuple, list)) and len(values) != len(self.key_bins):
            raise CodecError(
                f"rope_theta lists {len(values)} bases for {len(self.key_bins)} layers; give one "
                "number or one per layer"
            )
        out = tuple(float(np.float32(v)) for v in values)
        for v in out:
            if not (math.isfinite(v) and v >= 0):
                raise CodecError(f"rope_theta must be 0 (off) or a positive number, got {v}")
        return out[0] if len(set(out)) == 1 else out

    @property
    def num_layers(self) -> int:
        return len(self.key_bins)

    @property
    def layer_thetas(self) -> tuple[float, ...]:
        """The rotary base of each layer (0: keys stay as they are)."""
        if isinstance(self.rope_theta, tuple):
            return self.rope_theta
        return (self.rope_theta,) * self.num_layers

    @property
    def derotates(self) -> bool:
        """Whether any layer's keys are turned back by their rotary angles."""
        return any(self.layer_thetas)

    @property
    def bitstream_version(self) -> int:
        """The lowest bitstream format version that holds this config: 2 for per-layer
        rotary bases, else 1."""
        return 2 if isinstance(self.rope_theta, tuple) else 1

    def bins(self, kind: str) -> tuple[int, ...]:
        return self.key_bins if kind == "k" else self.value_bins

    def scale(self, kind: str) -> str:
        return self.key_scale if kind == "k" else self.value_scale

    def check_geometry(self, num_layers: int, head_dim: int) -> None:
        if self.num_layers != num_layers:
            raise CodecError(
                f"quantization config has {self.num_layers} layers, the model has {num_layers}"
            )
        if self.hadamard and head_dim & (head_dim - 1):
            raise CodecError(
                f"the Hadamard rotation needs a power-of-two head_dim, the model has {head_dim}"
            )
        if self.derotates and head_dim % 2:
            raise CodecError(
                "turning keys back by their rotary angles needs an even head_dim, "
                f"the model has {head_dim}"
            )

    # -- serialization: JSON for profiles, compact bytes for bitstream headers --------------

    def to_dict(self) -> dict:
        out = {
            "key_bins": list(self.key_bins),
            "value_bins": list(self.value_bins),
            "key_scale": self.key_scale,
            "value_scale": self.value_scale,
            "hadamard": self.hadamard,
            "group_size": self.group_size,
            "description": self.description,
        }
        # Written only when on, so the ids of levels made before these options stay the same.
        if self.derotates:
            thetas = self.rope_theta
            out["rope_theta"] = list(thetas) if isinstance(thetas, tuple) else thetas
        if self.exact_tokens:
            out["exact_tokens"] = self.exact_tokens
        return out

    @classmethod
    def from_dict(cls, data: dict) -> QuantConfig:
        try:
            return cls(
                key_bins=tuple(data["key_bins"]),
                value_bins=tuple(data["value_bins"]),
                key_scale=str(data.get("key_scale", "token")),
                value_scale=str(data.get("value_scale", "token")),
                hadamard=bool(data.get("hadamard", False)),
                group_size=int(data.get("group_size", 0)),
                rope_theta=_thetas_from_json(data.get("rope_theta", 0.0)),
                exact_tokens=int(data.get("exact_tokens", 0)),
                description=str(data.get("description", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CodecError(f"malformed quantization config: {exc!r}") from exc

    def pack(self) -> bytes:
        """Compact form for bitstream headers: flags, group size, run-length coded bins, then
        (flag bit 5) rope_theta as float32 and exact_tokens as u16, then (flag bit 6, format
        version 2, rope_theta 0) run-length coded per-layer rotary bases."""
        per_layer = isinstance(self.rope_theta, tuple)
        extended = bool(self.derotates or self.exact_tokens)
        flags = (
            SCALE_KINDS.index(self.key_scale)
            | SCALE_KINDS.index(self.value_scale) << 2
            | int(self.hadamard) << 4
            | (FLAG_EXTENDED if extended else 0)
            | (FLAG_LAYER_THETAS if per_layer else 0)
        )
        out = bytearray(struct.pack("<BH", flags, self.group_size))
        for bins in (self.key_bins, self.value_bins):
            runs = _runs(bins)
            out += struct.pack("<H", len(runs))
            for count, value in runs:
                out += struct.pack("<HH", count, value)
        if extended:
            out += _EXTENSION.pack(0.0 if per_layer else self.rope_theta, self.exact_tokens)
        if per_layer:
            runs = _runs(self.rope_theta)
            out += struct.pack("<H", len(runs))
            for count, value in runs:
                out += _THETA_RUN.pack(count, value)
        return bytes(out)

    @classmethod
    def unpack(cls, data: bytes) -> QuantConfig:
        try:
            flags, group = struct.unpack_from("<BH", data, 0)
            pos = 3
            lists = []
            for _ in range(2):
                (nruns,) = struct.unpack_from("<H", data, pos)
                pos += 2
                if pos + 4 * nruns > len(data):
                    raise CodecError("quantization config is truncated")
                bins: list[int] = []
                for _ in range(nruns):
                    count, value = struct.unpack_from("<HH", data, pos)
                    pos += 4
                    if len(bins) + count > 65535:
                        raise CodecError("quantization config has too many layers")
                    bins += [value] * count
                lists.append(tuple(bins))
            rope_theta: float | tuple[float, ...] = 0.0
            exact_tokens = 0
            if flags & FLAG_EXTENDED:
                rope_theta, exact_tokens = _EXTENSION.unpack_from(data, pos)
                pos += _EXTENSION.size
            if flags & FLAG_LAYER_THETAS:
                (nruns,) = struct.unpack_from("<H", data, pos)
                pos += 2
                if pos + _THETA_RUN.size * nruns > len(data) or rope_theta:
                    raise CodecError("quantization config is malformed (rotary bases)")
                thetas: list[float] = []
                for _ in range(nruns):
                    count, value = _THETA_RUN.unpack_from(data, pos)
                    pos += _THETA_RUN.size
                    thetas += [value] * count
                if len(thetas) != len(lists[0]):
                    raise CodecError("quantization config is malformed (rotary bases)")
                rope_theta = tuple(thetas)
            if (
                pos != len(data)
                or flags >> 7
                or (flags & 3) >= len(SCALE_KINDS)
                or (flags >> 2 & 3) >= len(SCALE_KINDS)
            ):
                raise CodecError("quantization config is malformed")
        except struct.error as exc:
            raise CodecError("quantization config is truncated") from exc
        return cls(
            key_bins=lists[0],
            value_bins=lists[1],
            key_scale=SCALE_KINDS[flags & 3],
            value_scale=SCALE_KINDS[flags >> 2 & 3],
            hadamard=bool(flags >> 4 & 1),
            group_size=group,
            rope_theta=rope_theta,
            exact_tokens=exact_tokens,
        )


def _thetas_from_json(value) -> float | tuple[float, ...]:
    if isinstance(value, list):
        return tuple(float(v) for v in value)
    return float(value)


def _runs(values: tuple) -> list[tuple]:
    """``(count, value)`` of each run of equal values, in order (as ``rotary.theta_runs``)."""
    return [(len(list(run)), value) for value, run in itertools.groupby(values)]


# ---- paper presets ---------------------------------------------------------------------------


def _split(num_layers: int, boundary_of_32: int) -> int:
    """A layer boundary given for a 32-layer model, scaled to ``num_layers`` (rounded up)."""
    return min(num_layers, max(1, math.ceil(boundary_of_32 * num_layers / 32)))


def paper_levels(num_layers: int) -> dict[int, QuantConfig]:
    """CacheGen's three quality levels (per-token scale, no rotation) scaled to the depth.

    For 32 layers: level 1 keys 16/16/12 bins by thirds and values 16 bins in layers 0-1,
    12 after; level 2 keys 32 bins in layers 0-9, 16 after and values 32 bins in layers
    0-1, 16 after; level 3 32 bins everywhere. Token-wise locality is off (the published
    implementation never shipped it; see docs/codec.md for what it does on real KV).
    """
    L = num_layers
    k10, v2, third = _split(L, 10), _split(L, 2), _split(L, 64 / 3)

    def stepwise(first: int, hi: int, lo: int) -> tuple[int, ...]:
        return tuple(hi if i < first else lo for i in range(L))

    return {
        1: QuantConfig(stepwise(third, 16, 12), stepwise(v2, 16, 12), description="paper level 1"),
        2: QuantConfig(stepwise(k10, 32, 16), stepwise(v2, 32, 16), description="paper level 2"),
        3: QuantConfig((32,) * L, (32,) * L, description="paper level 3"),
    }


# ---- kernels --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int) -> torch.Tensor:
    """The orthonormal (and symmetric) Sylvester Hadamard matrix of order ``n``, float32, CPU."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Multiply the last dimension by the orthonormal Hadamard matrix."""
    h = hadamard_matrix(x.shape[-1]).to(device=x.device, dtype=x.dtype)
    return x @ h


def num_scales(kind: str, layers: int, heads: int, tokens: int, head_dim: int) -> int:
    if kind == "token":
        return layers * tokens
    if kind == "token-head":
        return layers * heads * tokens
    return layers * heads * head_dim


def scale_strides(kind: str, tokens: int, head_dim: int) -> tuple[int, int, int]:
    """(per head, per token, per channel) strides into one layer's scales
    (see rans.decode_streams)."""
    if kind == "token":
        return 0, 1, 0
    if kind == "token-head":
        return tokens, 1, 0
    return 0, 0, 1


def _amax(x: torch.Tensor, kind: str) -> torch.Tensor:
    a = x.abs()
    if kind == "token":
        return a.amax(dim=(1, 3), keepdim=True)  # [L, 1, T, 1]
    if kind == "token-head":
        return a.amax(dim=3, keepdim=True)  # [L, H, T, 1]
    return a.amax(dim=2, keepdim=True)  # [L, H, 1, D]


def _scale_shape(kind: str, L: int, H: int, n: int, D: int) -> tuple[int, int, int, int]:
    return {"token": (L, 1, n, 1), "token-head": (L, H, n, 1), "channel": (L, H, 1, D)}[kind]


def _max_levels(bins: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor([max_level(b) for b in bins], dtype=torch.float32, device=device).view(
        -1, 1, 1, 1
    )


def _round_scales(amax: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 maxima (what the bitstream stores) and the float32 factor that maps x to levels."""
    if not torch.isfinite(amax).all():
        raise CodecError("the KV contains NaN or infinite values; they cannot be quantized")
    amax16 = amax.clamp(max=FP16_MAX).to(torch.float16)
    a = amax16.to(torch.float32)
    return amax16, torch.where(a > 0, m / a, torch.zeros_like(a))


def quantize(
    x: torch.Tensor, bins: tuple[int, ...], kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symbols (uint8, ``level + max_level``) and fp16 scales of ``x`` [L, H, T, D].

    Scales are the fp16-rounded absolute maxima; quantizing with the rounded value makes the
    decoder's reconstruction exact to what the encoder intended. On CPU this runs the numba
    kernels (reading bfloat16 or float32 in place), elsewhere plain torch; both give
    identical results.
    """
    if x.device.type == "cpu":
        src = kernel_source(x)
        amax16, inv = cpu_scales(src, bins, kind)
        out = np.empty(src.shape, dtype=np.uint8)
        levels = np.array([max_level(b) for b in bins], dtype=np.int64)
        code = SCALE_KINDS.index(kind)
        run_batches(
            lambda todo: qkernels.quantize_layers(src, code, inv, levels, out, todo),
            np.ones(src.shape[0]),
        )
        return torch.from_numpy(out), amax16
    return quantize_reference(x, bins, kind)


def quantize_reference(
    x: torch.Tensor, bins: tuple[int, ...], kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch implementation of :func:`quantize` (any device)."""
    x = x.to(torch.float32)
    m = _max_levels(bins, x.device)
    amax16, inv = _round_scales(_amax(x, kind), m)
    q = torch.round(x * inv).clamp_(-m, m).add_(m)
    return q.to(torch.uint8), amax16


def kernel_source(x: torch.Tensor) -> np.ndarray:
    """What the CPU kernels read: a C-contiguous array of bfloat16 (uint16) or float32
    (uint32) bits."""
    if x.dtype == torch.bfloat16:
        return np.ascontiguousarray(x.view(torch.int16).numpy()).view(np.uint16)
    return np.ascontiguousarray(x.to(torch.float32).numpy()).view(np.uint32)


def cpu_scales(
    src: np.ndarray, bins: tuple[int, ...], kind: str
) -> tuple[torch.Tensor, np.ndarray]:
    """fp16 scales (shaped like :func:`_amax`) and the flat float32 factors ``max_level / amax``."""
    L, H, n, D = src.shape
    shape = _scale_shape(kind, L, H, n, D)
    amax = np.empty(math.prod(shape), dtype=np.float32)
    non_finite: list[bool] = []
    code = SCALE_KINDS.index(kind)
    run_batches(
        lambda todo: non_finite.append(qkernels.amax_layers(src, code, amax, todo)), np.ones(L)
    )
    if any(non_finite):
        raise CodecError("the KV contains NaN or infinite values; they cannot be quantized")
    amax16, inv = _round_scales(
        torch.from_numpy(amax).view(shape), _max_levels(bins, torch.device("cpu"))
    )
    return amax16, inv.contiguous().numpy().reshape(-1)


def dequantize(symbols: torch.Tensor, amax16: torch.Tensor, bins: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`quantize` (float32)."""
    m = _max_levels(bins, symbols.device)
    return (symbols.to(torch.float32) - m) * (amax16.to(torch.float32) / m)


@dataclass
class Segment:
    """Symbols of one kind of token (all, anchors or deltas) of one of K/V, ready to code."""

    symbols: torch.Tensor  # uint8 [L, H, n, D]
    scales: torch.Tensor  # float16, shape depends on the scale kind
    tokens: torch.Tensor  # int64 [n]: token positions inside the chunk


def segment_tokens(num_tokens: int, group_size: int) -> list[torch.Tensor]:
    """Token positions of each segment of a chunk: all tokens, or anchors then deltas."""
    idx = torch.arange(num_tokens)
    if group_size == 0:
        return [idx]
    anchor = idx % group_size == 0
    return [idx[anchor], idx[~anchor]]


def quantize_chunk(
    x: torch.Tensor, config: QuantConfig, kind: str, start: int = 0
) -> list[Segment]:
    """Quantize one chunk's keys or values (``kind`` "k"/"v"), x [L, H, T, D] (any float dtype)
    whose first token is at position ``start`` of its sequence."""
    bins, scale = config.bins(kind), config.scale(kind)
    if kind == "k" and config.derotates:
        x = rotate_layer_keys(x.to(torch.float32), start, config.layer_thetas, inverse=True)
    if config.hadamard:
        x = hadamard(x.to(torch.float32))
    parts = segment_tokens(x.shape[2], config.group_size)
    if len(parts) == 1:
        q, s = quantize(x, bins, scale)
        return [Segment(q, s, parts[0])]
    anchors_idx, deltas_idx = parts
    qa, sa = quantize(x[:, :, anchors_idx], bins, scale)
    anchors_hat = dequantize(qa, sa, bins)
    owner = deltas_idx // config.group_size  # anchor number of each delta token
    qd, sd = quantize(x[:, :, deltas_idx].to(torch.float32) - anchors_hat[:, :, owner], bins, scale)
    return [Segment(qa, sa, anchors_idx), Segment(qd, sd, deltas_idx)]


def reconstruct(
    decoded: torch.Tensor, config: QuantConfig, kind: str, start: int = 0
) -> torch.Tensor:
    """Undo locality, rotation and (keys) the rotary de-rotation on one chunk's dequantized
    segments, in place when it can; the chunk starts at position ``start``.

    ``decoded`` [L, H, T, D] float32 holds the dequantized anchors at anchor positions and
    dequantized deltas elsewhere.
    """
    if config.group_size:
        T = decoded.shape[2]
        idx = torch.arange(T, device=decoded.device)
        owner = (idx // config.group_size) * config.group_size
        delta = idx % config.group_size != 0
        decoded[:, :, delta] += decoded[:, :, owner[delta]]
    if config.hadamard:
        decoded = hadamard(decoded)
    if kind == "k" and config.derotates:
        decoded = rotate_layer_keys(decoded, start, config.layer_thetas)
    return decoded


def exact_count(config: QuantConfig, start: int, num_tokens: int) -> int:
    """How many of the tokens at positions ``start ..`` are stored exactly."""
    return max(0, min(num_tokens, config.exact_tokens - start))
