"""What every codec shares: encoding into the common bitstream, decoding out of it.

A codec encodes a ``KVCache`` chunk by chunk (``chunk_tokens`` tokens per frame) into the
container of ``bitstream.py``; its subclass only writes and reads one frame's *body*. On
the decoding side a codec class builds a :class:`FrameDecoder` from the header; the
decoder first checks every frame body's size against what the header implies (so nothing
is allocated for input that cannot be valid), then decodes into one preallocated tensor.

A ``KVCache`` of a subset of the model's layers (``kv.layers``) encodes like any other: the
header lists the layers (format version 3), bodies hold just those layers, and "layers"
below (``Header.num_layers``) means the layers the stream holds.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from cachegen.codec.coding.bitstream import Frame, Header, pack_frame, pack_header
from cachegen.codec.errors import CodecError
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache
from cachegen.models import ModelSpec
from cachegen.modes import CODED

MAX_CHUNK_TOKENS = 1 << 20


class FrameDecoder:
    """Decodes the frames of one bitstream (subclasses implement the three hooks)."""

    def __init__(self, header: Header) -> None:
        self.header = header

    def check(self, frame: Frame) -> None:
        """Raise ``CodecError`` unless the body's layout matches the header (no decoding)."""
        raise NotImplementedError

    def decode_frame(self, frame: Frame, out: torch.Tensor, token_offset: int) -> None:
        """Write the frame's K/V into ``out[:, :, :, token_offset : token_offset + n]``.

        ``out`` is ``[2, layers, heads, tokens, head_dim]`` (keys, values) in the output dtype,
        ``layers`` those the stream holds.
        """
        raise NotImplementedError

    def layer_bytes(self, frame: Frame) -> np.ndarray:
        """Bytes of the body attributed to each (layer, K/V): ``[layers, 2]`` int64."""
        raise NotImplementedError

    def inspect_extras(self) -> dict:
        """What ``inspect`` reports beyond the common fields (e.g. a shared table or basis)."""
        return {}

    def checked_output(self, frames: list[Frame], out_dtype: torch.dtype) -> torch.Tensor:
        """The uninitialised output of :meth:`decode`, once every frame passed :meth:`check`."""
        for frame in frames:
            self.check(frame)
        h = self.header
        return torch.empty(
            (2, h.num_layers, h.num_kv_heads, h.num_tokens, h.head_dim), dtype=out_dtype
        )

    def decode(self, frames: list[Frame], out_dtype: torch.dtype) -> torch.Tensor:
        out = self.checked_output(frames, out_dtype)
        offset = 0
        for frame in frames:
            self.decode_frame(frame, out, offset)
            offset += len(frame.token_ids)
        return out


class Codec:
    """Base class: ``encode`` produces a self-contained bitstream for any token range."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool] = False
    # how a level's symbols may be stored: entropy-coded, and for some codecs bit-packed
    forms: ClassVar[tuple[str, ...]] = (CODED,)

    def __init__(self, chunk_tokens: int = CHUNK_TOKENS) -> None:
        if not 1 <= int(chunk_tokens) <= MAX_CHUNK_TOKENS:
            raise CodecError(f"chunk_tokens must be in 1..{MAX_CHUNK_TOKENS}, got {chunk_tokens}")
        self.chunk_tokens = int(chunk_tokens)

    @property
    def levels(self) -> list[int]:
        return [0]

    @property
    def default_level(self) -> int:
        return 0

    @property
    def profile_id(self) -> str:
        """Identifies everything a decoder must share with this encoder beyond the bitstream."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}(chunk_tokens={self.chunk_tokens})"

    def resolve_level(self, level: int | None) -> int:
        if level is None:
            return self.default_level
        if level not in self.levels:
            raise CodecError(f"codec {self.name} has no level {level}; levels are {self.levels}")
        return int(level)

    def encode(self, kv: KVCache, level: int | None = None, form: str = CODED) -> bytes:
        """``kv`` as a bitstream at ``level`` (default: the codec's default level), its
        symbols in ``form``: one of the codec's :attr:`forms`."""
        if form not in self.forms:
            raise CodecError(
                f"codec {self.name} has no form {form!r}; its forms are {', '.join(self.forms)}"
            )
        level = self.resolve_level(level)
        params, version = self.header_params(kv, level, form)
        header, token_width = pack_header(
            self.codec_id, level, kv, self.chunk_tokens, params, version, form=form
        )
        body = self.encode_body if form == CODED else self.encode_packed_body
        parts = [header]
        if kv.num_tokens:
            for chunk in kv.chunks(self.chunk_tokens):
                parts.append(pack_frame(chunk.token_ids, token_width, body(chunk, level)))
        return b"".join(parts)

    # -- subclass hooks --------------------------------------------------------------------

    def params(self, kv: KVCache, level: int) -> bytes:
        """Codec parameters stored in the header (what the decoder needs beyond geometry)."""
        return b""

    def header_params(self, kv: KVCache, level: int, form: str) -> tuple[bytes, int]:
        """The header's codec parameters and format version for ``level`` in ``form``."""
        return self.params(kv, level), self.bitstream_version(level)

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        raise NotImplementedError

    def encode_packed_body(self, chunk: KVCache, level: int) -> bytes:
        """A frame body of the packed form (codecs with ``PACKED`` among their :attr:`forms`)."""
        raise NotImplementedError

    def bitstream_version(self, level: int) -> int:
        """The bitstream format version that ``level``'s parameters need (``pack_header``
        raises it to 3 for a layer subset)."""
        return 1

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        raise NotImplementedError


class ModelCodec(Codec):
    """A codec whose levels live in what was fitted for one model (a profile, a basis, a
    model file): given, loaded by the model's name, or loaded for the first KV encoded."""

    fitted_kind: ClassVar[str]  # what the fitted thing is called in messages

    def __init__(self, model: ModelSpec | str | None, chunk_tokens: int, fitted) -> None:
        super().__init__(chunk_tokens)
        if fitted is None and model is not None:
            fitted = self.load_fitted(model)
        self._fitted = fitted

    @staticmethod
    def load_fitted(model: ModelSpec | str):
        """What was fitted for ``model`` (by its name or spec)."""
        raise NotImplementedError

    @property
    def fitted(self):
        if self._fitted is None:
            raise CodecError(
                f"the {self.name} codec needs a model for its {self.fitted_kind}: "
                f"get_codec({self.name!r}, model=NAME)"
            )
        return self._fitted

    def fit_for(self, kv: KVCache) -> None:
        """Load what was fitted for ``kv``'s model if the codec was made without a model."""
        if self._fitted is None:
            self._fitted = self.load_fitted(kv.model.name)

    @property
    def levels(self) -> list[int]:
        return sorted(self.fitted.levels)

    @property
    def profile_id(self) -> str:
        return self.fitted.id

    def __repr__(self) -> str:
        model = self._fitted.model.name if self._fitted else None
        return f"{type(self).__name__}(model={model!r}, chunk_tokens={self.chunk_tokens})"


def check_size(frame: Frame, expected: int, what: str) -> None:
    if len(frame.body) != expected:
        raise CodecError(
            f"frame {frame.index} is corrupt: {what} body is {len(frame.body)} bytes, "
            f"expected {expected}"
        )


def kv_tensor(chunk: KVCache) -> torch.Tensor:
    """``[2, L, H, n, D]`` keys and values of a chunk (one copy, on the CPU)."""
    return torch.stack([chunk.keys, chunk.values]).cpu()
