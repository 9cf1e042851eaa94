"""The container every codec writes: a small self-describing header and checksummed frames.

Layout (all integers little-endian; full spec in ``docs/bitstream.md``)::

    header  : fixed part (32 bytes), model name, model fingerprint, codec parameters,
              [layer list: u16 count, u16 layer indices; only with flag bit 2], CRC-32
    frame i : u32 payload length, u32 CRC-32 of the payload, payload
              (one frame per ``chunk_tokens`` tokens; the last one may be shorter)
    payload : token ids (u16 or u32 each), then the codec's body for those tokens

A stream may hold only some of the model's layers (flag bit 2, format version 3): the header's
``num_layers`` stays the model's, the layer list names the layers present, and the frame
bodies hold just those layers. A ``cachegen`` stream may hold its symbols bit-packed at a
fixed width instead of entropy-coded (flag bit 3, format version 4: the *packed form*). A
``tcq`` stream's frames may carry per-component offsets and table choices (a frame-layout
byte after its model id, format version 5). Writers use the lowest version a stream needs
(1; 2 for per-layer rotary bases; 3 for a layer subset; 4 for the packed form; 5 for tcq's
choices), so every other stream is what it always was.

Parsing checks every length against the bytes actually present and every checksum before a
codec sees a byte of its body, so corrupt or hostile input fails fast with ``CodecError``
and never makes the decoder allocate more than the input can justify.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import torch
from isal.isal_zlib import crc32  # zlib's CRC-32, several times faster (the frame checks)

from cachegen.codec.errors import CodecError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.modes import CODED, FORMS, PACKED

MAGIC = b"CGKV"
VERSION = 7  # the newest format this cachegen reads; writers use the lowest that holds a stream
VERSIONS = (1, 2, 3, 4, 5, 6, 7)
LAYER_SUBSET_VERSION = 3  # the first version whose header may carry a layer list
PACKED_VERSION = 4  # the first version whose frames may hold bit-packed symbols
_FIXED = struct.Struct("<4sBBHBBHHHQII")  # 32 bytes
_FRAME = struct.Struct("<II")

FLAG_TOKENS_U32 = 1
FLAG_FINGERPRINT_DIGEST = 2
FLAG_LAYER_SUBSET = 4  # a layer list follows the codec parameters (version 3)
FLAG_PACKED = 8  # the frames hold bit-packed symbols, the packed form (version 4)
_KNOWN_FLAGS = FLAG_TOKENS_U32 | FLAG_FINGERPRINT_DIGEST | FLAG_LAYER_SUBSET | FLAG_PACKED

DTYPE_CODES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

MAX_ELEMENTS_PER_TOKEN = 1 << 24  # layers * heads * head_dim; far above any real model
MAX_TOKENS = 1 << 30


@dataclass(frozen=True)
class Header:
    codec_id: int
    level: int
    dtype: torch.dtype  # dtype of the KV that was encoded
    token_width: int  # 2 or 4 bytes per token id
    model: ModelIdentity
    start: int
    num_tokens: int
    chunk_tokens: int
    params: bytes  # codec-specific
    size: int  # header bytes
    version: int = 1  # format version the stream was written in
    layers: tuple[int, ...] | None = None  # absolute indices of the layers held; None = all
    form: str = CODED  # PACKED: the symbols are bit-packed at a fixed width (flag bit 3)

    @property
    def num_layers(self) -> int:
        """Layers the frames hold (``model.num_layers`` is the model's)."""
        return self.model.num_layers if self.layers is None else len(self.layers)

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """Absolute index of each layer the frames hold, in their order."""
        return tuple(range(self.model.num_layers)) if self.layers is None else self.layers

    @property
    def num_kv_heads(self) -> int:
        return self.model.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.head_dim

    @property
    def num_frames(self) -> int:
        return -(-self.num_tokens // self.chunk_tokens)

    def frame_tokens(self, index: int) -> int:
        return min(self.chunk_tokens, self.num_tokens - index * self.chunk_tokens)

    @property
    def num_elements(self) -> int:
        """Elements of keys and values together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.num_tokens


@dataclass(frozen=True)
class Frame:
    index: int
    token_ids: np.ndarray  # int64
    body: memoryview
    size: int  # bytes including the frame header


def _fingerprint_bytes(fingerprint: str) -> tuple[bytes, bool]:
    if len(fingerprint) == 64 and all(ch in "0123456789abcdef" for ch in fingerprint):
        return bytes.fromhex(fingerprint), True
    data = fingerprint.encode()
    if len(data) > 255:
        raise CodecError("model fingerprint is longer than 255 bytes")
    return data, False


def pack_header(
    codec_id: int,
    level: int,
    kv: KVCache,
    chunk_tokens: int,
    params: bytes,
    version: int = 1,
    form: str = CODED,
) -> tuple[bytes, int]:
    """Header bytes for ``kv`` and the token id width chosen; ``version`` is the format
    version the codec's parameters need. A layer subset (``kv.layers``) adds the layer list
    and needs version 3, the packed form needs version 4 (the header says the highest)."""
    if version not in VERSIONS:
        raise CodecError(f"cannot write bitstream format version {version}")
    if form not in FORMS:
        raise CodecError(f"unknown form {form!r}; use {' or '.join(FORMS)}")
    subset = kv.layers
    if subset is not None:
        version = max(version, LAYER_SUBSET_VERSION)
    if form == PACKED:
        version = max(version, PACKED_VERSION)
    if kv.dtype not in DTYPE_CODES:
        raise CodecError(f"cannot encode KV of dtype {kv.dtype}; use float16, bfloat16 or float32")
    if not 0 <= level <= 0xFFFF:
        raise CodecError(f"level must fit in 16 bits, got {level}")
    if kv.num_tokens > MAX_TOKENS or kv.start + kv.num_tokens >= 1 << 63:
        raise CodecError(
            f"{kv.num_tokens} tokens from position {kv.start} are more than a bitstream holds"
        )
    ids = kv.token_ids
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 32):
        raise CodecError("token ids must be in [0, 2**32)")
    token_width = 4 if ids.numel() and int(ids.max()) >= 1 << 16 else 2
    name = kv.model.name.encode()
    if len(name) > 255:
        raise CodecError(f"model name {kv.model.name[:40]!r}... is longer than 255 bytes")
    fp, digest = _fingerprint_bytes(kv.model.fingerprint)
    flags = (
        (FLAG_TOKENS_U32 if token_width == 4 else 0)
        | (FLAG_FINGERPRINT_DIGEST if digest else 0)
        | (FLAG_LAYER_SUBSET if subset is not None else 0)
        | (FLAG_PACKED if form == PACKED else 0)
    )
    if len(params) > 0xFFFF:
        raise CodecError("codec parameters are too large for the header")
    out = bytearray(
        _FIXED.pack(
            MAGIC,
            version,
            codec_id,
            level,
            DTYPE_CODES[kv.dtype],
            flags,
            kv.model.num_layers,
            kv.num_kv_heads,
            kv.head_dim,
            kv.start,
            kv.num_tokens,
            chunk_tokens,
        )
    )
    out += (
        bytes([len(name)]) + name + bytes([len(fp)]) + fp + struct.pack("<H", len(params)) + params
    )
    if subset is not None:
        out += struct.pack(f"<H{len(subset)}H", len(subset), *subset)
    out += struct.pack("<I", crc32(out))
    return bytes(out), token_width


def pack_frame(
    token_ids: torch.Tensor, token_width: int, body: bytes | bytearray | memoryview
) -> bytes:
    ids = token_ids.numpy().astype("<u4" if token_width == 4 else "<u2").tobytes()
    payload = ids + bytes(body)
    return _FRAME.pack(len(payload), crc32(payload)) + payload


def parse_header(blob: bytes | memoryview) -> Header:
    """Validate and read the header (no frames)."""
    view = memoryview(blob)
    if len(view) < _FIXED.size:
        raise CodecError(f"not a cachegen bitstream: {len(view)} bytes is shorter than a header")
    fixed = _FIXED.unpack_from(view, 0)
    _check_fixed_part(fixed)
    (
        _,
        version,
        codec_id,
        level,
        dtype_code,
        flags,
        layers,
        heads,
        head_dim,
        start,
        tokens,
        chunk,
    ) = fixed
    name, fp, params, subset, pos = _read_variable_part(
        view, layers, bool(flags & FLAG_LAYER_SUBSET)
    )
    if subset is not None:
        _check_layer_list(subset, layers)
        if len(subset) * heads * head_dim > MAX_ELEMENTS_PER_TOKEN:
            raise CodecError("bitstream header is corrupt (impossible KV geometry)")
    try:
        name_str = name.decode()
        fp_str = fp.hex() if flags & FLAG_FINGERPRINT_DIGEST else fp.decode()
    except UnicodeDecodeError as exc:
        raise CodecError("bitstream header is corrupt (model name is not UTF-8)") from exc
    model = ModelIdentity(
        name=name_str, fingerprint=fp_str, num_layers=layers, num_kv_heads=heads, head_dim=head_dim
    )
    return Header(
        codec_id=codec_id,
        level=level,
        dtype=DTYPES[dtype_code],
        token_width=4 if flags & FLAG_TOKENS_U32 else 2,
        model=model,
        start=start,
        num_tokens=tokens,
        chunk_tokens=chunk,
        params=params,
        size=pos + 4,
        version=version,
        layers=subset,
        form=PACKED if flags & FLAG_PACKED else CODED,
    )


def _check_fixed_part(fixed: tuple) -> None:
    """Raise ``CodecError`` unless the header's fixed part is one this cachegen reads."""
    magic, version, _, _, dtype_code, flags, layers, heads, head_dim, start, tokens, chunk = fixed
    if magic != MAGIC:
        raise CodecError("not a cachegen bitstream (bad magic bytes)")
    if version not in VERSIONS:
        raise CodecError(
            f"bitstream format version {version} is not supported (this cachegen reads versions "
            f"{', '.join(map(str, VERSIONS))}); upgrade cachegen to read it"
        )
    if dtype_code not in DTYPES or flags & ~_KNOWN_FLAGS:
        raise CodecError("bitstream header is corrupt (unknown dtype or flags)")
    has_subset = bool(flags & FLAG_LAYER_SUBSET)
    if has_subset and version < LAYER_SUBSET_VERSION:
        raise CodecError(
            f"bitstream header is corrupt (a layer list in a format version {version} stream)"
        )
    if flags & FLAG_PACKED and version < PACKED_VERSION:
        raise CodecError(
            f"bitstream header is corrupt (packed symbols in a format version {version} stream)"
        )
    if not (layers and heads and head_dim) or (
        not has_subset and layers * heads * head_dim > MAX_ELEMENTS_PER_TOKEN
    ):
        raise CodecError("bitstream header is corrupt (impossible KV geometry)")
    if chunk == 0 or tokens > MAX_TOKENS or start + tokens >= 1 << 63:
        raise CodecError("bitstream header is corrupt (impossible token range or chunk size)")


def _read_variable_part(
    view: memoryview, num_layers: int, has_subset: bool
) -> tuple[bytes, bytes, bytes, tuple[int, ...] | None, int]:
    """The model name, fingerprint, codec parameters and layer list after the fixed part,
    and where the header's CRC-32 is, once it matches."""
    pos = _FIXED.size
    try:
        name_len = view[pos]
        name = bytes(view[pos + 1 : pos + 1 + name_len])
        pos += 1 + name_len
        fp_len = view[pos]
        fp = bytes(view[pos + 1 : pos + 1 + fp_len])
        pos += 1 + fp_len
        (params_len,) = struct.unpack_from("<H", view, pos)
        params = bytes(view[pos + 2 : pos + 2 + params_len])
        pos += 2 + params_len
        subset: tuple[int, ...] | None = None
        if has_subset:
            (count,) = struct.unpack_from("<H", view, pos)
            if not 0 < count <= num_layers:
                raise CodecError(
                    f"bitstream header is corrupt (its layer list holds {count} of the model's "
                    f"{num_layers} layers)"
                )
            subset = struct.unpack_from(f"<{count}H", view, pos + 2)
            pos += 2 + 2 * count
        (crc,) = struct.unpack_from("<I", view, pos)
    except (IndexError, struct.error) as exc:
        raise CodecError("bitstream is truncated inside its header") from exc
    if len(name) != name_len or len(fp) != fp_len or len(params) != params_len:
        raise CodecError("bitstream is truncated inside its header")
    if crc32(view[:pos]) != crc:
        raise CodecError("bitstream header is corrupt (checksum mismatch)")
    return name, fp, params, subset, pos


def _check_layer_list(subset: tuple[int, ...], num_layers: int) -> None:
    for a, b in zip(subset, subset[1:]):
        if b <= a:
            raise CodecError(
                f"bitstream header is corrupt (layer list is not strictly increasing: {a} then {b})"
            )
    if subset[-1] >= num_layers:
        raise CodecError(
            f"bitstream header is corrupt (layer {subset[-1]} in its layer list is out of "
            f"range for a model of {num_layers} layers)"
        )


FRAME_HEADER_BYTES = _FRAME.size  # each frame's payload length and CRC-32


def stream_length(blob: bytes | memoryview, header: Header) -> int:
    """Bytes of the stream ``header`` begins in ``blob`` (its header and frames), read from
    the frames' lengths alone: for a stream that other bytes follow (a fixed-size record)."""
    end = header.size
    for index in range(header.num_frames):
        if end + _FRAME.size > len(blob):
            raise CodecError(f"bitstream is truncated before frame {index}")
        length, _ = _FRAME.unpack_from(blob, end)
        end += _FRAME.size + length
    if end > len(blob):
        raise CodecError(f"bitstream is truncated inside frame {header.num_frames - 1}")
    return end


def parse_frames(blob: bytes | memoryview, header: Header) -> list[Frame]:
    """Split the bytes after the header into frames, checking lengths, counts and checksums."""
    view = memoryview(blob)
    # Every frame holds at least its frame header and token ids: reject a token count the
    # input cannot hold before looking further (or allocating anything for it).
    minimum = header.size + header.num_frames * _FRAME.size + header.num_tokens * header.token_width
    if len(view) < minimum:
        raise CodecError(
            f"bitstream is truncated: {len(view)} bytes cannot hold {header.num_tokens} tokens "
            f"(at least {minimum} bytes needed)"
        )
    frames = []
    pos = header.size
    for index in range(header.num_frames):
        if pos + _FRAME.size > len(view):
            raise CodecError(f"bitstream is truncated before frame {index}")
        length, crc = _FRAME.unpack_from(view, pos)
        begin, end = pos + _FRAME.size, pos + _FRAME.size + length
        if end > len(view):
            raise CodecError(
                f"bitstream is truncated inside frame {index} ({length} bytes announced, "
                f"{len(view) - begin} present)"
            )
        payload = view[begin:end]
        if crc32(payload) != crc:
            raise CodecError(f"frame {index} is corrupt (checksum mismatch)")
        n = header.frame_tokens(index)
        id_bytes = n * header.token_width
        if length < id_bytes:
            raise CodecError(f"frame {index} is too short for its {n} token ids")
        ids = np.frombuffer(
            payload[:id_bytes], dtype="<u4" if header.token_width == 4 else "<u2"
        ).astype(np.int64)
        frames.append(Frame(index=index, token_ids=ids, body=payload[id_bytes:], size=end - pos))
        pos = end
    if pos != len(view):
        raise CodecError(f"bitstream has {len(view) - pos} unexpected trailing bytes")
    return frames


def read_token_ids(blob: bytes | memoryview, header: Header) -> np.ndarray:
    """The token ids of every frame, in order (int64), read from the frame headers' lengths
    and the start of each payload; ``blob`` may end after the last frame's ids. Unverified:
    no frame checksum is checked (what ids a stream holds, e.g. to tell which KV it is, without
    reading its bodies; a decoder uses :func:`parse_frames`). Raises ``CodecError`` when the
    bytes end first or a frame is too short for its ids."""
    view = memoryview(blob)
    dtype = "<u4" if header.token_width == 4 else "<u2"
    parts = []
    pos = header.size
    for index in range(header.num_frames):
        id_bytes = header.frame_tokens(index) * header.token_width
        if pos + _FRAME.size + id_bytes > len(view):
            raise CodecError(f"bitstream ends before the token ids of frame {index}")
        (length, _) = _FRAME.unpack_from(view, pos)
        if length < id_bytes:
            raise CodecError(f"frame {index} is too short for its token ids")
        begin = pos + _FRAME.size
        parts.append(np.frombuffer(view[begin : begin + id_bytes], dtype=dtype))
        pos = begin + length
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
