"""Decoding the cachegen codec's frames, both forms (layout: ``cachegen_codec.py``).

:class:`LevelDecoder` holds what both forms share: the level's config, each frame's exact
tokens and scales, and dequantizing the symbols into the output (then undoing the level's
transforms). :class:`CacheGenDecoder` reads the coded form's rANS streams,
:class:`PackedDecoder` the packed form's bit-packed ones.
"""

from __future__ import annotations

import numpy as np
import torch

from cachegen.codec.base import FrameDecoder
from cachegen.codec.cachegen import packed
from cachegen.codec.cachegen.encode import exact_section_bytes, layer_config, stream_widths
from cachegen.codec.cachegen.frame import (
    frame_steps,
    row_transform,
    scratch,
    strided_views,
    transform_layers,
)
from cachegen.codec.cachegen.quant import (
    QuantConfig,
    exact_count,
    max_level,
    num_scales,
    reconstruct,
    scale_strides,
    segment_tokens,
)
from cachegen.codec.coding import rans
from cachegen.codec.coding.bitstream import Frame, Header
from cachegen.codec.coding.parallel import run_batches, run_jobs
from cachegen.codec.coding.tables import KINDS, LevelTables, num_segments
from cachegen.codec.errors import CodecError
from cachegen.codec.transform.rotary import rotary_cos_sin, theta_runs

_SLACK_BITS = 0.05  # per symbol, covers rANS rounding in the size lower bound (see check)


class LevelDecoder(FrameDecoder):
    """What both forms share: the level's config, the frame's exact tokens and scales, and
    dequantizing the symbols into the output (then undoing the level's transforms). A
    subclass reads the symbols: :meth:`_symbol_kernel`."""

    # whether the symbol kernel undoes the level's transforms row by row (it then takes the
    # ``transform`` argument of ``packed.decode_streams``)
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

    def inspect_extras(self) -> dict:
        return {"profile_tables": self.tables_id, "config": self.config.to_dict()}

    def _frame_start(self, frame: Frame) -> int:
        """Position of the frame's first token in its sequence."""
        return self.header.start + frame.index * self.header.chunk_tokens

    def _exact_tokens(self, frame: Frame) -> int:
        return exact_count(self.config, self._frame_start(frame), len(frame.token_ids))

    def _exact_bytes(self, frame: Frame) -> int:
        h = self.header
        return exact_section_bytes(h.num_layers, h.model, self._exact_tokens(frame), h.dtype)

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
        """A function ``(todo, status, dequantize, transform)`` that decodes the frame's streams
        ``todo`` with the ``dequantize`` argument of ``rans.decode_streams`` and, if the kernel
        undoes the level's transforms (``transforms_rows``), the ``transform`` argument of
        ``packed.decode_streams`` (``status[k]`` 1: stream ``k`` is corrupt)."""
        raise NotImplementedError

    def decode(self, frames: list[Frame], out_dtype: torch.dtype) -> torch.Tensor:
        """Every frame's streams in one hand-out to the threads when the kernels write the
        output themselves (no frame needs the shared float32 scratch), else frame by frame."""
        if not self._writes_output(out_dtype):
            return super().decode(frames, out_dtype)
        out = self.checked_output(frames, out_dtype)
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
        config = self.layer_config  # per-layer settings indexed like the stream's layers
        n = len(frame.token_ids)
        # Three paths: dequantize straight into ``out`` (the packed form also undoes the
        # Hadamard product and the rotary angles of keys row by row on the way); decode into a
        # float32 scratch and let a kernel transform it into ``out``; or decode, reconstruct in
        # torch and copy (token locality, or an output dtype the kernels do not write).
        direct = self._writes_output(out.dtype)
        fused_rotation = (
            out.dtype in (torch.bfloat16, torch.float32) and not config.group_size and not direct
        )
        if direct:
            target, T, t0 = out, out.shape[3], token_offset
        else:
            target, T, t0 = scratch((2, L, H, n, D)), n, 0
        ntok, dequantize = self._dequantize_args(frame, target, T, t0)
        status = np.zeros(self.num_streams, dtype=np.uint8)
        decode_symbols = self._symbol_kernel(frame, ntok)
        # (first layer, end layer, cos and sin or None) of each run of layers sharing a base
        rotary = [
            (a, b, rotary_cos_sin(self._frame_start(frame), n, D, theta) if theta else None)
            for a, b, theta in theta_runs(config.layer_thetas)
        ]
        transform = None
        if self.transforms_rows:
            transformed = bool(config.hadamard or config.derotates)
            transform = row_transform(config.hadamard, rotary, n, self.S, direct and transformed)
        rows = out[:, :, :, token_offset : token_offset + n]

        def kernel(todo: np.ndarray) -> None:
            decode_symbols(todo, status, dequantize, transform)
            if fused_rotation:
                transform_layers(todo, target, rows, config.hadamard, rotary)

        def finish() -> None:
            self._finish_frame(frame, status, target, rows, direct or fused_rotation)

        return kernel, ntok * H * D + 1, finish

    def _dequantize_args(
        self, frame: Frame, target: torch.Tensor, T: int, t0: int
    ) -> tuple[np.ndarray, tuple]:
        """Each stream's token count, and the ``dequantize`` argument of the symbol kernels
        (see ``rans.decode_streams``) for writing into ``target``, whose token axis is ``T``
        long with the frame's first token at ``t0``."""
        n, D = len(frame.token_ids), self.header.head_dim
        layout, _ = self._layout(n)
        ntok, scale_rel, entry, stride, center, token_off, block, levels = self._stream_plan(n)
        # scales: fp16 absolute maxima -> float32 step (amax / max_level) per layer
        scales, first_step, token_map = frame_steps(
            frame.body, self._exact_bytes(frame), layout, levels, self.header.num_layers, t0
        )
        scale_off = first_step[entry] + scale_rel
        out_f32, out_bf16 = strided_views(target.view(-1))
        dequantize = (scales, scale_off, stride, center, D, token_map, token_off)
        return ntok, (*dequantize, out_f32, out_bf16, block * T * D, T)

    def _finish_frame(
        self,
        frame: Frame,
        status: np.ndarray,
        decoded: torch.Tensor,
        rows: torch.Tensor,
        written: bool,
    ) -> None:
        """After the symbol kernels: raise if a stream is corrupt, reconstruct ``decoded``
        into the frame's ``rows`` of the output unless the kernels ``written`` them, then
        copy the exact tokens."""
        if status.any():
            raise CodecError(
                f"frame {frame.index} is corrupt: {int(status.sum())} of {self.num_streams} "
                "streams do not decode cleanly"
            )
        if not written:
            for k, kind in enumerate(KINDS):
                rows[k] = reconstruct(decoded[k], self.layer_config, kind, self._frame_start(frame))
        e = self._exact_tokens(frame)
        if e:
            h = self.header
            exact = torch.frombuffer(
                bytearray(frame.body[: self._exact_bytes(frame)]), dtype=h.dtype
            ).view(2, h.num_layers, h.num_kv_heads, e, h.head_dim)
            rows[:, :, :, :e] = exact


class CacheGenDecoder(LevelDecoder):
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

        def decode(todo: np.ndarray, status: np.ndarray, dequantize: tuple, _) -> None:
            rans.decode_streams(
                words,
                word_off,
                channels,
                num_tokens,
                self.table_base,
                t.slots,
                t.freq_cum,
                dequantize,
                todo,
                status,
            )

        return decode


class PackedDecoder(LevelDecoder):
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

        def decode(todo: np.ndarray, status: np.ndarray, dequantize: tuple, transform) -> None:
            packed.decode_streams(
                data, offsets, widths, channels, num_tokens, dequantize, transform, todo, status
            )

        return decode
