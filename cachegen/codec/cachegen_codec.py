"""The CacheGen codec: layer-wise quantization, optional token locality, per-channel rANS.

Per frame (``chunk_tokens`` tokens) the keys and values are quantized with the level's
:class:`~cachegen.codec.quant.QuantConfig` into symbol *segments* (all tokens, or anchors
and deltas when token locality is on); every (layer, K/V, segment) becomes one rANS stream
coded with the profile's per-channel tables. Frame body::

    exact      the frame's exactly stored tokens (positions below the level's ``exact_tokens``):
               keys then values [L, H, e, D] in the KV's dtype; empty in most frames
    scales     fp16, for K then V, for each segment: [L, n] (token), [L, H, n] (token-head)
               or [L, H, D] (channel)
    directory  u32 word count of each stream, streams ordered (layer, K/V, segment)
    streams    the rANS streams, little-endian u16 words (layout in rans.py)

The header's codec parameters are the 16-byte tables id followed by the packed config, so
the decoder needs nothing but the bitstream and (the tables, or the model to rebuild them).

A stream of a layer subset (``KVCache.layers``) holds those layers only (``L`` above is the
number present); every per-layer setting (bins, rotary base, table rows) is the one of the
layer's absolute index, so a subset decodes to exactly the values of the same layers of a
full stream: every scale, symbol and rANS stream belongs to one layer.

The *packed form* (``encode(kv, level, form="packed")``, header flag bit 3) stores the same
exact tokens and scales, then one width byte per stream and the streams' symbols bit-packed
at that width (``packed.py``) instead of the directory and the rANS streams. It decodes to the
same KV, bit for bit, at memory speed, and needs no probability tables.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import numpy as np
import torch

from cachegen import models
from cachegen.codec import packed, rans
from cachegen.codec.base import Codec, FrameDecoder
from cachegen.codec.bitstream import CODED, FORMS, PACKED, Frame, Header, pack_frame, pack_header
from cachegen.codec.errors import CodecError
from cachegen.codec.parallel import run_batches, run_jobs
from cachegen.codec.profile import Profile, load_profile
from cachegen.codec.qkernels import store_transformed
from cachegen.codec.quant import (
    QuantConfig,
    exact_count,
    max_level,
    num_scales,
    quantize_chunk,
    reconstruct,
    rotary_cos_sin,
    scale_strides,
    segment_tokens,
    theta_runs,
)
from cachegen.codec.tables import KINDS, LevelTables, find_tables, num_segments
from cachegen.kv import KVCache, ModelIdentity

TABLES_ID_BYTES = 16
_SLACK_BITS = 0.05  # per symbol, covers rANS rounding in the size lower bound (see check)


class CacheGenCodec(Codec):
    name = "cachegen"
    codec_id = 6

    def __init__(
        self,
        model: models.ModelSpec | str | None = None,
        chunk_tokens: int = 256,
        profile: Profile | None = None,
    ) -> None:
        super().__init__(chunk_tokens)
        if profile is None and model is not None:
            profile = load_profile(model)
        self._profile = profile

    @property
    def profile(self) -> Profile:
        if self._profile is None:
            raise CodecError(
                "the cachegen codec needs a model for its profile: "
                "get_codec('cachegen', model=NAME)"
            )
        return self._profile

    @property
    def levels(self) -> list[int]:
        return sorted(self.profile.levels)

    @property
    def default_level(self) -> int:
        return self.profile.default_level

    @property
    def profile_id(self) -> str:
        return self.profile.id

    def __repr__(self) -> str:
        model = self._profile.model.name if self._profile else None
        return f"CacheGenCodec(model={model!r}, chunk_tokens={self.chunk_tokens})"

    def encode(self, kv: KVCache, level: int | None = None, form: str = CODED) -> bytes:
        """``form`` "coded" entropy-codes the symbols (smallest), "packed" stores them
        bit-packed (larger, decodes at memory speed to the same KV)."""
        if form not in FORMS:
            raise CodecError(f"unknown form {form!r}; use {' or '.join(FORMS)}")
        if self._profile is None:
            self._profile = load_profile(kv.model.name)
        if kv.model.fingerprint != self.profile.model.fingerprint:
            raise CodecError(
                f"KV of model {kv.model.name} cannot use the profile of {self.profile.model.name}"
            )
        if form == CODED:
            return super().encode(kv, level)
        level = self.resolve_level(level)
        config = self.profile.config(level)
        header, token_width = pack_header(
            self.codec_id,
            level,
            kv,
            self.chunk_tokens,
            self.params(kv, level),
            self.bitstream_version(level),
            form=PACKED,
        )
        chunks = kv.chunks(self.chunk_tokens) if kv.num_tokens else []
        return header + b"".join(
            pack_frame(chunk.token_ids, token_width, encode_packed_chunk(chunk, config))
            for chunk in chunks
        )

    def params(self, kv: KVCache, level: int) -> bytes:
        tables = self.profile.tables(level)
        return bytes.fromhex(tables.id) + tables.config.pack()

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        tables = self.profile.tables(level)
        return encode_chunk(chunk, tables)

    def bitstream_version(self, level: int) -> int:
        return self.profile.config(level).bitstream_version

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        params = header.params
        if len(params) <= TABLES_ID_BYTES:
            raise CodecError("cachegen bitstream header is corrupt (parameters)")
        config = QuantConfig.unpack(params[TABLES_ID_BYTES:])
        if config.bitstream_version > header.version:
            raise CodecError(
                f"cachegen bitstream header is corrupt (per-layer rotary bases in a format "
                f"version {header.version} stream)"
            )
        config.check_geometry(header.model.num_layers, header.head_dim)
        tables_id = params[:TABLES_ID_BYTES].hex()
        if header.form == PACKED:
            return PackedDecoder(header, config, tables_id)
        tables = find_tables(tables_id, config, header.model)
        m = tables.model
        if (m.num_layers, m.num_kv_heads, m.head_dim) != (
            header.model.num_layers,
            header.num_kv_heads,
            header.head_dim,
        ):
            raise CodecError("cachegen bitstream geometry does not match its profile tables")
        return CacheGenDecoder(header, tables)


# ---- layer subsets --------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def layer_config(config: QuantConfig, layers: tuple[int, ...] | None) -> QuantConfig:
    """``config`` for a KV that holds only ``layers`` (absolute indices; None: all): the bins
    and rotary bases of those layers, in their order, so that index ``i`` of the result is
    layer ``layers[i]`` of the model. Everything else applies to every layer alike."""
    if layers is None:
        return config
    thetas = config.layer_thetas
    return dataclasses.replace(
        config,
        key_bins=tuple(config.key_bins[i] for i in layers),
        value_bins=tuple(config.value_bins[i] for i in layers),
        rope_theta=tuple(thetas[i] for i in layers),
    )


# ---- encoding -------------------------------------------------------------------------------


def _exact_section_bytes(layers: int, model: ModelIdentity, tokens: int, dtype: torch.dtype) -> int:
    """Size of a frame body's exact section holding ``tokens`` tokens (keys and values) of
    ``layers`` layers."""
    return 2 * layers * model.num_kv_heads * tokens * model.head_dim * dtype.itemsize


def exact_bytes(chunk: KVCache, config: QuantConfig) -> int:
    """Size of the frame body's exact section for ``chunk``."""
    return _exact_section_bytes(
        chunk.num_layers,
        chunk.model,
        exact_count(config, chunk.start, chunk.num_tokens),
        chunk.dtype,
    )


def encode_chunk(chunk: KVCache, tables: LevelTables) -> bytes:
    """Frame body for one chunk (see the module docstring); ``chunk`` may hold a subset of
    the layers (``chunk.layers``)."""
    L = chunk.num_layers
    config = layer_config(tables.config, chunk.layers)
    layer_ids = chunk.layer_indices
    e = exact_count(config, chunk.start, chunk.num_tokens)
    exact = torch.stack([chunk.keys[:, :, :e], chunk.values[:, :, :e]]).cpu().contiguous()
    scale_parts: list[bytes] = [exact.view(torch.uint8).numpy().tobytes()]
    outputs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per (K/V, segment)
    for k, kind in enumerate(KINDS):
        x = chunk.keys if kind == "k" else chunk.values
        for s, seg in enumerate(quantize_chunk(x, config, kind, chunk.start)):
            scale_parts.append(seg.scales.cpu().numpy().tobytes())
            sym = seg.symbols.cpu().numpy()  # quantization may run on a GPU, coding runs here
            capacity = sym[0].size + rans.STATE_WORDS
            out_off = np.arange(L + 1, dtype=np.int64) * capacity
            out = np.empty(int(out_off[-1]), dtype=np.uint16)
            start = np.empty(L, dtype=np.int64)
            base = np.array([tables.base(layer, k, s) for layer in layer_ids], dtype=np.int64)
            run_batches(
                lambda todo: rans.encode_layers(
                    sym, base, tables.freq_cum, out, out_off, todo, start
                ),
                np.ones(L),
            )
            outputs.append((out, start, out_off))
    # streams ordered (layer, K/V, segment)
    streams = [
        out[start[layer] : off[layer + 1]] for layer in range(L) for out, start, off in outputs
    ]
    lengths = np.array([len(w) for w in streams], dtype="<u4")
    return (
        b"".join(scale_parts) + lengths.tobytes() + np.concatenate(streams).astype("<u2").tobytes()
    )


def stream_widths(config: QuantConfig, num_segments: int) -> np.ndarray:
    """Packed width of each stream, ordered (layer, K/V, segment), of the layers ``config``
    describes."""
    return np.array(
        [
            packed.symbol_width(config.bins(kind)[layer])
            for layer in range(config.num_layers)
            for kind in KINDS
            for _ in range(num_segments)
        ],
        dtype=np.uint8,
    )


def encode_packed_chunk(chunk: KVCache, level_config: QuantConfig) -> bytes:
    """Packed-form frame body for one chunk: the coded form's exact tokens and scales, then
    one width byte per stream and the bit-packed streams, ordered (layer, K/V, segment)."""
    L = chunk.num_layers
    config = layer_config(level_config, chunk.layers)
    e = exact_count(config, chunk.start, chunk.num_tokens)
    exact = torch.stack([chunk.keys[:, :, :e], chunk.values[:, :, :e]]).cpu().contiguous()
    parts: list[bytes] = [exact.view(torch.uint8).numpy().tobytes()]
    segments: list[np.ndarray] = []  # per (K/V, segment): symbols [L, H, n_s, D]
    for kind in KINDS:
        x = chunk.keys if kind == "k" else chunk.values
        for seg in quantize_chunk(x, config, kind, chunk.start):
            parts.append(seg.scales.cpu().numpy().tobytes())
            segments.append(np.ascontiguousarray(seg.symbols.cpu().numpy()))
    per_layer = len(segments)  # streams per layer: K/V times segments
    widths = stream_widths(config, per_layer // 2)
    counts = np.tile([sym[0].size for sym in segments], L)
    sizes = packed.packed_bytes(counts, widths.astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    out = np.zeros(int(offsets[-1]), dtype=np.uint8)
    for j, sym in enumerate(segments):
        streams = np.arange(L) * per_layer + j  # this segment's stream in each layer
        run_batches(
            lambda todo, sym=sym, streams=streams: packed.pack_layers(
                sym, widths[streams], out, offsets[streams], todo
            ),
            np.ones(L),
        )
    return b"".join(parts) + widths.tobytes() + out.tobytes()


# ---- decoding -------------------------------------------------------------------------------


class _LevelDecoder(FrameDecoder):
    """What both forms share: the level's config, the frame's exact tokens and scales, and
    dequantizing the symbols into the output (then undoing the level's transforms). A
    subclass reads the symbols: :meth:`_symbol_kernel`."""

    # whether the symbol kernel undoes the level's transforms row by row (it then takes the
    # arguments of ``_row_transform`` after the dequantization arguments)
    transforms_rows = False

    def __init__(self, header: Header, config: QuantConfig, tables_id: str) -> None:
        super().__init__(header)
        self.config = config  # the level's config, every layer of the model
        # the config of the layers the stream holds (index i: layer ``layer_ids[i]``)
        self.layer_config = layer_config(config, header.layers)
        self.layer_ids = header.layer_indices
        self.tables_id = tables_id
        self.S = num_segments(config)
        self.num_streams = header.num_layers * 2 * self.S
        # per frame length: what every frame of that length shares (a bitstream's frames
        # but its last have one length)
        self._layouts: dict[int, tuple] = {}
        self._stream_plans: dict[int, tuple] = {}

    def _frame_start(self, frame: Frame) -> int:
        """Position of the frame's first token in its sequence."""
        return self.header.start + frame.index * self.header.chunk_tokens

    def _exact_tokens(self, frame: Frame) -> int:
        return exact_count(self.config, self._frame_start(frame), len(frame.token_ids))

    def _exact_bytes(self, frame: Frame) -> int:
        h = self.header
        return _exact_section_bytes(h.num_layers, h.model, self._exact_tokens(frame), h.dtype)

    def _layout(self, n: int):
        """Per (K/V, segment): token positions, scale count; plus total scale bytes."""
        if n not in self._layouts:
            self._layouts[n] = self._new_layout(n)
        return self._layouts[n]

    def _new_layout(self, n: int):
        h = self.header
        segs = segment_tokens(n, self.config.group_size)
        layout = []
        for kind in KINDS:
            for tokens in segs:
                count = num_scales(
                    self.config.scale(kind), h.num_layers, h.num_kv_heads, len(tokens), h.head_dim
                )
                layout.append((kind, tokens, count))
        return layout, 2 * sum(c for _, _, c in layout)

    def _stream_tokens(self, n: int) -> np.ndarray:
        """Tokens of each stream of a frame of ``n`` tokens, ordered (layer, K/V, segment)."""
        return self._stream_plan(n)[0]

    def _stream_plan(self, n: int) -> tuple:
        """Per stream of a frame of ``n`` tokens (ordered layer, K/V, segment): its token
        count, first scale (relative to its layout entry's), scale strides, centre symbol,
        first token in the token map, and the (K/V, layer) block it writes; per layout entry
        the symbols' largest level per layer, and the token map's offsets."""
        if n not in self._stream_plans:
            self._stream_plans[n] = self._new_stream_plan(n)
        return self._stream_plans[n]

    def _new_stream_plan(self, n: int) -> tuple:
        h = self.header
        L, D, S = h.num_layers, h.head_dim, self.S
        config = self.layer_config
        layout, _ = self._layout(n)
        lengths = [len(tokens) for _, tokens, _ in layout]
        tm_off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        levels = [
            np.array([max_level(b) for b in config.bins(kind)], dtype=np.float32)[:, None]
            for kind, _, _ in layout
        ]
        num = self.num_streams
        ntok = np.empty(num, dtype=np.int64)
        scale_off = np.empty(num, dtype=np.int64)
        entry = np.empty(num, dtype=np.int64)
        stride = np.empty((num, 3), dtype=np.int64)
        center = np.empty(num, dtype=np.int32)
        token_off = np.empty(num, dtype=np.int64)
        block = np.empty(num, dtype=np.int64)
        for layer in range(L):
            for k, kind in enumerate(KINDS):
                for s in range(S):
                    j = k * S + s  # (K/V, segment) of the layout
                    i = (layer * 2 + k) * S + s  # stream
                    _, tokens, count = layout[j]
                    ntok[i] = lengths[j]
                    entry[i] = j
                    scale_off[i] = layer * (count // L)
                    stride[i] = scale_strides(config.scale(kind), lengths[j], D)
                    center[i] = max_level(config.bins(kind)[layer])
                    token_off[i] = tm_off[j]
                    block[i] = (k * L + layer) * h.num_kv_heads
        return ntok, scale_off, entry, stride, center, token_off, block, levels

    def _layer_overheads(self, frame: Frame) -> np.ndarray:
        """Bytes of the exact tokens and the scales attributed to each (layer, K/V)."""
        h = self.header
        layout, _ = self._layout(len(frame.token_ids))
        out = np.zeros((h.num_layers, 2), dtype=np.float64)
        for i, (_, _, count) in enumerate(layout):
            out[:, i // self.S] += 2 * count / h.num_layers
        return out + self._exact_bytes(frame) / (2 * h.num_layers)

    def _symbol_kernel(self, frame: Frame, num_tokens: np.ndarray):
        """A function ``(todo, status, *dequantize)`` that decodes the frame's streams ``todo``
        with the dequantization arguments of ``rans.decode_streams`` (``status[k]`` 1: stream
        ``k`` is corrupt)."""
        raise NotImplementedError

    def decode(self, frames: list[Frame], out_dtype: torch.dtype) -> torch.Tensor:
        """Every frame's streams in one hand-out to the threads when the kernels write the
        output themselves (no frame needs the shared float32 scratch), else frame by frame."""
        if not self._writes_output(out_dtype):
            return super().decode(frames, out_dtype)
        for frame in frames:
            self.check(frame)
        h = self.header
        out = torch.empty(
            (2, h.num_layers, h.num_kv_heads, h.num_tokens, h.head_dim), dtype=out_dtype
        )
        jobs, offset = [], 0
        for frame in frames:
            jobs.append(self._frame_job(frame, out, offset))
            offset += len(frame.token_ids)
        run_jobs([(kernel, work) for kernel, work, _ in jobs])
        for _, _, finish in jobs:
            finish()
        return out

    def _writes_output(self, out_dtype: torch.dtype) -> bool:
        """Whether the symbol kernel writes the final values into the output itself."""
        config = self.layer_config
        transformed = bool(config.hadamard or config.derotates)
        return (
            out_dtype in (torch.bfloat16, torch.float32)
            and not config.group_size
            and (not transformed or self.transforms_rows)
        )

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        kernel, work, finish = self._frame_job(frame, out, token_offset)
        run_batches(kernel, work)
        finish()

    def _frame_job(self, frame: Frame, out: torch.Tensor, token_offset: int):
        """``(kernel, work, finish)``: run ``kernel`` on batches of the frame's streams
        (``work``: their relative costs, as ``run_batches`` takes them), then ``finish()``."""
        h = self.header
        L, H, D = h.num_layers, h.num_kv_heads, h.head_dim
        C = H * D
        config = self.layer_config  # per-layer settings indexed like the stream's layers
        n = len(frame.token_ids)
        layout, scale_bytes = self._layout(n)

        # Three paths: dequantize straight into ``out`` (the packed form also undoes the
        # Hadamard product and the rotary angles of keys row by row on the way); decode into a
        # float32 scratch and let a kernel transform it into ``out``; or decode, reconstruct in
        # torch and copy (token locality, or an output dtype the kernels do not write).
        transformed = bool(config.hadamard or config.derotates)
        direct = self._writes_output(out.dtype)
        fused_rotation = (
            out.dtype in (torch.bfloat16, torch.float32) and not config.group_size and not direct
        )
        if direct:
            target, T, t0 = out, out.shape[3], token_offset
        else:
            target, T, t0 = _scratch((2, L, H, n, D)), n, 0

        # scales: fp16 absolute maxima -> float32 step (amax / max_level) per layer
        ntok, scale_rel, entry, stride, center, token_off, block, levels = self._stream_plan(n)
        steps, scale_off_of, token_maps = [], [], []
        pos = exact_end = self._exact_bytes(frame)
        total = 0
        for (_, tokens, count), m in zip(layout, levels):
            amax = (
                np.frombuffer(frame.body[pos : pos + 2 * count], dtype="<f2")
                .astype(np.float32)
                .reshape(L, -1)
            )
            pos += 2 * count
            steps.append((amax / m).reshape(-1))
            scale_off_of.append(total)
            total += count
            token_maps.append(tokens.numpy().astype(np.int64) + t0)
        scales = np.concatenate(steps) if steps else np.zeros(0, np.float32)
        token_map = np.concatenate(token_maps)
        scale_off = np.asarray(scale_off_of, dtype=np.int64)[entry] + scale_rel
        out_base = block * T * D

        num = self.num_streams
        status = np.zeros(num, dtype=np.uint8)
        dec_f32, dec_bf16 = _strided_views(target.view(-1))
        dequantize = (
            scales,
            scale_off,
            stride,
            center,
            D,
            token_map,
            token_off,
            dec_f32,
            dec_bf16,
            out_base,
            T,
        )
        decode_symbols = self._symbol_kernel(frame, ntok)
        start = self._frame_start(frame)
        # (first layer, end layer, cos and sin or None) of each run of layers sharing a base
        rotary = [
            (a, b, rotary_cos_sin(start, n, D, theta) if theta else None)
            for a, b, theta in theta_runs(config.layer_thetas)
        ]
        row_transform = _row_transform(config.hadamard, rotary, n, self.S, direct and transformed)
        symbol_args = (*dequantize, *row_transform) if self.transforms_rows else dequantize

        def kernel(todo: np.ndarray) -> None:
            decode_symbols(todo, status, *symbol_args)
            if fused_rotation:
                # Streams are (layer, K/V) without locality and ``todo`` is a contiguous range,
                # so its keys and its values are each a contiguous run of layers: transform them
                # while they are in cache, in one numba pass (it releases the GIL).
                for k in range(2):
                    layers = todo[todo % 2 == k] // 2
                    if not len(layers):
                        continue
                    first, end = int(layers[0]), int(layers[-1]) + 1
                    for run_first, run_end, angles in rotary:
                        a, b = max(first, run_first), min(end, run_end)
                        if a >= b:
                            continue
                        block = target[k, a:b]
                        rows = out[k, a:b, :, token_offset : token_offset + n].view(-1, n, D)
                        rotate = k == 0 and angles is not None
                        cos, sin = angles if rotate else (_NO_ANGLES, _NO_ANGLES)
                        store_transformed(
                            block.reshape(-1, n, D).numpy(),
                            config.hadamard,
                            cos.numpy(),
                            sin.numpy(),
                            rotate,
                            *_strided_views(rows),
                        )

        def finish() -> None:
            if status.any():
                raise CodecError(
                    f"frame {frame.index} is corrupt: {int(status.sum())} of {num} streams "
                    "do not decode cleanly"
                )
            if not direct and not fused_rotation:
                for k, kind in enumerate(KINDS):
                    out[k, :, :, token_offset : token_offset + n] = reconstruct(
                        target[k], config, kind, start
                    )
            e = self._exact_tokens(frame)
            if e:
                exact = torch.frombuffer(bytearray(frame.body[:exact_end]), dtype=h.dtype).view(
                    2, L, H, e, D
                )
                out[:, :, :, token_offset : token_offset + e] = exact

        return kernel, ntok * C + 1, finish


class CacheGenDecoder(_LevelDecoder):
    """The coded form: a stream directory, then rANS streams under the level's tables."""

    def __init__(self, header: Header, tables: LevelTables) -> None:
        super().__init__(header, tables.config, tables.id)
        self.tables = tables
        # Lower bound of each stream's code length per token: sum over channels of the
        # cheapest symbol's bits (see docs/bitstream.md, "size checks").
        per_row = np.maximum(tables.cheapest_symbol_bits - _SLACK_BITS, 0.0)
        per_layer = per_row.reshape(header.model.num_layers, 2 * self.S, tables.num_channels)
        self.stream_bits_per_token = (
            per_layer[list(self.layer_ids)]
            .reshape(self.num_streams, tables.num_channels)
            .sum(axis=1)
        )
        self.table_base = np.array(
            [
                tables.base(index, k, s)
                for index in self.layer_ids
                for k in range(2)
                for s in range(self.S)
            ],
            dtype=np.int64,
        )

    def _directory(self, frame: Frame) -> tuple[np.ndarray, int]:
        n = len(frame.token_ids)
        _, scale_bytes = self._layout(n)
        dir_end = self._exact_bytes(frame) + scale_bytes + 4 * self.num_streams
        if len(frame.body) < dir_end:
            raise CodecError(
                f"frame {frame.index} is corrupt: {len(frame.body)} bytes cannot hold its scales "
                "and stream directory"
            )
        words = np.frombuffer(
            frame.body[dir_end - 4 * self.num_streams : dir_end], dtype="<u4"
        ).astype(np.int64)
        return words, dir_end

    def check(self, frame: Frame) -> None:
        words, dir_end = self._directory(frame)
        if 2 * int(words.sum()) != len(frame.body) - dir_end:
            raise CodecError(
                f"frame {frame.index} is corrupt: stream directory does not match the frame size"
            )
        stream_tokens = self._stream_tokens(len(frame.token_ids))
        needed = rans.STATE_WORDS + np.floor(
            np.maximum(stream_tokens * self.stream_bits_per_token - 16 * rans.LANES, 0) / 17
        )
        if np.any(words < needed):
            raise CodecError(
                f"frame {frame.index} is corrupt: a stream is shorter than its symbols "
                "can be coded in"
            )

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        h = self.header
        words, _ = self._directory(frame)
        return (
            self._layer_overheads(frame)
            + 2 * words.reshape(h.num_layers, 2, self.S).sum(axis=2)
            + 4 * self.S  # streams + directory
        )

    def _symbol_kernel(self, frame: Frame, num_tokens: np.ndarray):
        words_per_stream, dir_end = self._directory(frame)
        words = np.frombuffer(frame.body[dir_end:], dtype="<u2")
        word_off = np.concatenate([[0], np.cumsum(words_per_stream)]).astype(np.int64)
        channels = np.full(self.num_streams, self.header.num_kv_heads * self.header.head_dim)
        t = self.tables

        def decode(todo: np.ndarray, status: np.ndarray, *dequantize) -> None:
            rans.decode_streams(
                words,
                word_off,
                channels,
                num_tokens,
                self.table_base,
                t.slots,
                t.freq_cum,
                *dequantize,
                todo,
                status,
            )

        return decode


class PackedDecoder(_LevelDecoder):
    """The packed form: one width byte per stream, then the bit-packed streams. Needs no
    probability tables."""

    transforms_rows = True  # its kernel undoes a level's transforms itself

    def __init__(self, header: Header, config: QuantConfig, tables_id: str) -> None:
        super().__init__(header, config, tables_id)
        self.widths = stream_widths(self.layer_config, self.S)

    def _sections(self, frame: Frame) -> tuple[np.ndarray, int]:
        """Byte offset of each stream in the body (``num_streams + 1`` of them), after checking
        the widths and the body's length against the header."""
        n = len(frame.token_ids)
        _, scale_bytes = self._layout(n)
        widths_at = self._exact_bytes(frame) + scale_bytes
        data_at = widths_at + self.num_streams
        if len(frame.body) < data_at:
            raise CodecError(
                f"frame {frame.index} is corrupt: {len(frame.body)} bytes cannot hold its scales "
                "and symbol widths"
            )
        widths = np.frombuffer(frame.body[widths_at:data_at], dtype=np.uint8)
        if not np.array_equal(widths, self.widths):
            raise CodecError(
                f"frame {frame.index} is corrupt: its packed symbol widths disagree with the "
                "level's bins in the header"
            )
        sizes = packed.packed_bytes(
            self._stream_tokens(n) * self.header.num_kv_heads * self.header.head_dim,
            self.widths.astype(np.int64),
        )
        offsets = data_at + np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        if offsets[-1] != len(frame.body):
            raise CodecError(
                f"frame {frame.index} is corrupt: its body is {len(frame.body)} bytes, its "
                f"header implies {offsets[-1]} for {n} tokens of packed symbols"
            )
        return offsets, data_at

    def check(self, frame: Frame) -> None:
        offsets, _ = self._sections(frame)
        # a stream's padding bits are zero: one packing per symbol sequence
        n = len(frame.token_ids)
        symbols = self._stream_tokens(n) * self.header.num_kv_heads * self.header.head_dim
        used = (symbols * self.widths) % 8  # bits used of each stream's last byte
        ends = offsets[1:] - 1
        body = np.frombuffer(frame.body, dtype=np.uint8)
        padded = (used > 0) & (offsets[1:] > offsets[:-1])
        if np.any(body[ends[padded]] >> used[padded].astype(np.uint8)):
            raise CodecError(
                f"frame {frame.index} is corrupt: a packed stream's padding bits are not zero"
            )

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        h = self.header
        offsets, _ = self._sections(frame)
        streams = np.diff(offsets).reshape(h.num_layers, 2, self.S).sum(axis=2)
        return self._layer_overheads(frame) + streams + self.S  # streams + width bytes

    def _symbol_kernel(self, frame: Frame, num_tokens: np.ndarray):
        offsets, data_at = self._sections(frame)
        data = np.frombuffer(frame.body, dtype=np.uint8)
        channels = np.full(self.num_streams, self.header.num_kv_heads * self.header.head_dim)
        widths = self.widths.astype(np.int64)

        def decode(todo: np.ndarray, status: np.ndarray, *dequantize) -> None:
            packed.decode_streams(
                data, offsets, widths, channels, num_tokens, *dequantize, todo, status
            )

        return decode


_scratch_buffers = threading.local()


def _scratch(shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 buffer reused by every frame this thread decodes. A fresh one per frame costs
    page faults, a large share of a frame's decoding (docs/codec.md, "Speed"), and the
    connector decodes each chunk as its own bitstream, with its own decoder."""
    size = int(np.prod(shape))
    buffer = getattr(_scratch_buffers, "float32", None)
    if buffer is None or buffer.numel() < size:
        buffer = _scratch_buffers.float32 = torch.empty(size, dtype=torch.float32)
    return buffer[:size].view(shape)


_NO_ANGLES = torch.zeros(1, 1)


def _row_transform(
    hadamard: bool, rotary: list, n: int, segments: int, active: bool
) -> tuple[bool, np.ndarray, np.ndarray, np.ndarray]:
    """The transform arguments of ``packed.decode_streams`` for a frame of ``n`` tokens:
    whether to undo the Hadamard product, the cos and sin rows of every run of layers with a
    rotary base (``rotary`` as ``decode_frame`` builds it) stacked, and each stream's first
    row of them (keys only; -1: not turned). Nothing to undo unless ``active``."""
    angle_row = np.full(2 * segments * (rotary[-1][1] if rotary else 0), -1, dtype=np.int64)
    runs = [(a, b, angles) for a, b, angles in rotary if angles is not None] if active else []
    if not runs:
        return hadamard and active, _NO_ANGLES.numpy(), _NO_ANGLES.numpy(), angle_row
    for i, (a, b, _) in enumerate(runs):
        for layer in range(a, b):  # keys: the first ``segments`` streams of the layer
            angle_row[2 * segments * layer : 2 * segments * layer + segments] = i * n
    cos = np.concatenate([angles[0].numpy() for _, _, angles in runs])
    sin = np.concatenate([angles[1].numpy() for _, _, angles in runs])
    return hadamard, cos, sin, angle_row


def _strided_views(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(float32 elements, bfloat16 bits) views of a CPU tensor of either dtype, any strides;
    the other one is empty (and of the same rank)."""
    if x.dtype == torch.bfloat16:
        return np.empty((0,) * x.dim(), np.float32), x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy(), np.empty((0,) * x.dim(), np.uint16)
