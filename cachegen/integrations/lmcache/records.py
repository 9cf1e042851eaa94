"""LMCache's KV chunks as cachegen bitstreams, each in a record of a fixed size.

LMCache hands a serde one chunk of KV as a tensor ``[2, num_layers, num_tokens, hidden]``
(keys then values; ``hidden`` is the KV heads' channels, head by head), and sizes the buffer a
record is stored from and loaded into by ``estimate_serialized_size`` of that layout alone:
its file-system and RESP adapters refuse a stored object of any other size. So a record is
the chunk's bitstream (``docs/bitstream.md``) followed by zeros up to a size fixed by the
layout (:meth:`RecordCodec.record_size`); a chunk whose bitstream does not fit is not stored.

The serde gets neither the chunk's tokens nor its position in the prompt: a stream's token
ids are zeros and its ``start`` is 0, which the codec's key rotation and exact first tokens
then assume (docs/guide/lmcache.md, "What it costs").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np
import torch

from cachegen.codec import CodecError, decode
from cachegen.codec.coding.bitstream import (
    FRAME_HEADER_BYTES,
    Header,
    parse_header,
    stream_length,
)
from cachegen.kv import KVCache, ModelIdentity

CODECS = ("tcq", "cachegen")  # the codecs with levels and a model file (or profile) per model
HEADER_BYTES = 512  # room for a header (about 100 to 130 bytes, docs/bitstream.md)
TOKEN_ID_BYTES = 2  # the zeros written as token ids fit u16
# The budget's margin over the codec's estimate from its model file: a chunk encoded as if it
# began the prompt, and text unlike the calibration text, cost more than the estimate.
BUDGET_MARGIN = 1.5


@dataclass(frozen=True)
class SerdeOptions:
    """The ``"serde"`` dict of an L2 adapter, less its ``"type"``."""

    model: str
    codec: str = "tcq"
    level: int | None = None  # None: the codec's default level for the model
    budget_bits: float | None = None  # record bits per KV element; None: from the estimate
    max_workers: int = 1  # LMCache's serde threads

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, object]) -> SerdeOptions:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise CodecError(
                f"cachegen serde: unknown option {unknown[0]!r}; known: {sorted(known)}"
            )
        if not isinstance(kwargs.get("model"), str) or not kwargs["model"]:
            raise CodecError('cachegen serde: "model" must name the model, e.g. "smollm2-135m"')
        options = cls(**kwargs)  # type: ignore[arg-type]
        if options.codec not in CODECS:
            raise CodecError(
                f"cachegen serde: codec must be one of {CODECS}, not {options.codec!r}"
            )
        return options


@dataclass(frozen=True)
class ChunkLayout:
    """The layout of one chunk in LMCache's memory: ``[2, num_layers, num_tokens, hidden]``."""

    num_layers: int
    num_tokens: int
    hidden: int
    dtype: torch.dtype

    @classmethod
    def of(cls, shapes: list[torch.Size], dtypes: list[torch.dtype]) -> ChunkLayout:
        if len(shapes) != 1:
            raise CodecError(
                f"cachegen serde: a chunk of {len(shapes)} kernel groups is not supported "
                "(one group of full-attention KV only)"
            )
        shape = tuple(shapes[0])
        if len(shape) != 4 or shape[0] != 2:
            raise CodecError(
                f"cachegen serde: LMCache layout {shape} is not [2, layers, tokens, hidden] "
                "(MLA and fused K/V layouts are not supported)"
            )
        return cls(shape[1], shape[2], shape[3], dtypes[0])

    @property
    def num_elements(self) -> int:
        return 2 * self.num_layers * self.num_tokens * self.hidden


class RecordCodec:
    """One model's codec at one level; writes each chunk as a record of a fixed size and reads
    back only records of its own (this model, this model file or profile, this layout)."""

    def __init__(self, codec, identity: ModelIdentity, level: int, budget_bits: float) -> None:
        if level not in codec.levels:
            raise CodecError(f"cachegen serde: {codec.name} has levels {codec.levels}, not {level}")
        self.codec = codec
        self.identity = identity
        self.level = level
        self.budget_bits = budget_bits

    @classmethod
    def from_options(cls, options: SerdeOptions) -> RecordCodec:
        """The codec of ``options``: its model file or profile is shipped or on this machine
        (a server never fits one; a missing one is a ``CodecError`` naming the command)."""
        from cachegen import models
        from cachegen.profiles import codec_for

        spec = models.resolve(options.model)
        codec = codec_for(options.codec, spec, build=False)
        level = codec.default_level if options.level is None else options.level
        budget = options.budget_bits
        if budget is None:
            budget = BUDGET_MARGIN * codec.estimated_bits(level, codec.chunk_tokens)
        return cls(codec, spec.identity(), level, budget)

    def record_size(self, layout: ChunkLayout) -> int:
        """Bytes of every record of ``layout``: the budget, a header and the frames' own."""
        self._check_layout(layout)
        frames = math.ceil(layout.num_tokens / self.codec.chunk_tokens)
        payload = math.ceil(self.budget_bits * layout.num_elements / 8)
        framing = frames * FRAME_HEADER_BYTES + layout.num_tokens * TOKEN_ID_BYTES
        return HEADER_BYTES + framing + payload

    def encode(self, chunk: torch.Tensor, out: torch.Tensor) -> int:
        """Write the record of ``chunk`` (LMCache's layout) into the byte tensor ``out``;
        returns its size."""
        layout = ChunkLayout.of([chunk.shape], [chunk.dtype])
        size = self.record_size(layout)
        blob = self.codec.encode(self._kv_of(chunk, layout), self.level)
        if len(blob) > size:
            raise CodecError(
                f"cachegen serde: a chunk's {self.codec.name} level {self.level} stream is "
                f"{len(blob)} bytes, over its record's {size}; it is not stored (raise "
                f'"budget_bits", now {self.budget_bits:.3f}, or choose a coarser level)'
            )
        if out.numel() < size:
            raise CodecError(
                f"cachegen serde: a {out.numel()}-byte buffer holds no {size}-byte record"
            )
        out[: len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        out[len(blob) : size].zero_()
        return size

    def decode_into(self, record: memoryview, out: torch.Tensor) -> None:
        """Decode ``record`` into ``out`` (LMCache's layout), refusing what is not one of this
        codec's records of that layout, before anything is sized from its header."""
        layout = ChunkLayout.of([out.shape], [out.dtype])
        size = self.record_size(layout)
        if len(record) < size:
            raise CodecError(
                f"cachegen serde: record is {len(record)} bytes, truncated from {size}"
            )
        record = record[:size]
        header = parse_header(record)
        self.expect(layout)(header)
        end = stream_length(record, header)
        if np.frombuffer(record[end:], dtype=np.uint8).any():
            raise CodecError("cachegen serde: record is damaged (bytes after its stream)")
        kv = decode(record[:end], out_dtype=out.dtype, expect=self.expect(layout))
        planes = out.view(2, layout.num_layers, layout.num_tokens, *self._heads)
        planes[0].copy_(kv.keys.permute(0, 2, 1, 3))
        planes[1].copy_(kv.values.permute(0, 2, 1, 3))

    def expect(self, layout: ChunkLayout):
        """A header check (``cachegen.codec.decode``'s ``expect``) for records of ``layout``."""

        def check(header: Header) -> None:
            _refuse_other(header, self.codec, self.identity, self._fitted_id(header.level))
            if header.layers is not None or header.num_tokens != layout.num_tokens:
                raise CodecError(
                    f"cachegen serde: record holds {header.num_tokens} tokens of layers "
                    f"{list(header.layer_indices)}, not the {layout.num_tokens} tokens of every "
                    "layer LMCache asks for; refused before decoding"
                )

        return check

    @property
    def _heads(self) -> tuple[int, int]:
        return self.identity.num_kv_heads, self.identity.head_dim

    def _check_layout(self, layout: ChunkLayout) -> None:
        heads, dim = self._heads
        if (layout.num_layers, layout.hidden) != (self.identity.num_layers, heads * dim):
            raise CodecError(
                f"cachegen serde: LMCache's chunk has {layout.num_layers} layers of "
                f"{layout.hidden} channels, not {self.identity.name}'s {self.identity.num_layers} "
                f"of {heads} heads x {dim} (another model, or a tensor-parallel shard)"
            )

    def _kv_of(self, chunk: torch.Tensor, layout: ChunkLayout) -> KVCache:
        planes = chunk.view(2, layout.num_layers, layout.num_tokens, *self._heads)
        planes = planes.permute(0, 1, 3, 2, 4)  # [2, layers, heads, tokens, head_dim]
        return KVCache(
            keys=planes[0],
            values=planes[1],
            token_ids=torch.zeros(layout.num_tokens, dtype=torch.int64),
            model=self.identity,
        )

    def _fitted_id(self, level: int) -> str | None:
        """The id of the model file (tcq) or tables (cachegen) a stream of ``level`` names."""
        if self.codec.name == "tcq":
            return self.codec.tcq.id
        return self.codec.profile.tables_ids.get(level)


def _refuse_other(header: Header, codec, identity: ModelIdentity, fitted_id: str | None) -> None:
    """Refuse a stream of another codec, model or geometry, or another model file."""
    if header.codec_id != codec.codec_id:
        raise CodecError(f"cachegen serde: record is not a {codec.name} stream; refused")
    if header.model != identity:
        raise CodecError(
            f"cachegen serde: record holds KV of {header.model.name} "
            f"({header.model.num_layers} layers, {header.model.num_kv_heads} heads x "
            f"{header.model.head_dim}), not of {identity.name}; refused before decoding"
        )
    if fitted_id is None or header.params[:16] != bytes.fromhex(fitted_id)[:16]:
        raise CodecError(
            f"cachegen serde: record was encoded with another {codec.name} model file or "
            f"profile (level {header.level}) than this serde's {codec.profile_id[:16]}; "
            "refused before decoding"
        )
