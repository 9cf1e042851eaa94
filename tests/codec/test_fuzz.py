"""Corrupt, truncated and hostile bitstreams end in CodecError, never a crash or a huge allocation.

Two kinds of mutation: plain ones (caught by lengths and CRC-32s) and *re-sealed* ones whose
checksums are recomputed after mutating, so the codecs' own structural checks are the only
defence. Hypothesis runs a few thousand cases in all.
"""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from cachegen.codec import CodecError, decode, inspect
from cachegen.codec.coding.bitstream import _FIXED, FLAG_LAYER_SUBSET, FLAG_PACKED, parse_header
from cachegen.kv import KVCache
from cachegen.profiles import codec_for

FUZZ = settings(
    max_examples=700,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
)


class Blobs(dict):
    def __repr__(self) -> str:  # keep hypothesis' failure reports readable
        return f"<{len(self)} bitstreams>"


@pytest.fixture(scope="module")
def blobs(tiny_llama) -> Blobs:
    from cachegen.extract import extract_kv

    kv = extract_kv(tiny_llama, text="Fuzzing a bitstream: " * 12).slice(3, 43)
    out = Blobs()
    for name, level in [
        ("raw", 0),
        ("int8", 0),
        ("fp8", 0),
        ("int8-zstd", 0),
        ("kivi2", 0),
        ("cachegen", 1),
        ("cachegen", 3),
    ]:
        out[f"{name}-{level}"] = codec_for(name, tiny_llama, chunk_tokens=16).encode(kv, level)
    # streams of a layer subset (format version 3: a layer list in the header)
    part = kv.select_layers([1, 3])
    for name, level in [("int8", 0), ("cachegen", 3)]:
        codec = codec_for(name, tiny_llama, chunk_tokens=16)
        out[f"{name}-{level}-layers"] = codec.encode(part, level)
    # the packed form (format version 4: bit-packed symbols)
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=16)
    for level in (1, 3):
        out[f"packed-{level}"] = codec.encode(kv, level, form="packed")
    out["packed-3-layers"] = codec.encode(part, 3, form="packed")
    return out


NAMES = [
    "raw-0",
    "int8-0",
    "fp8-0",
    "int8-zstd-0",
    "kivi2-0",
    "cachegen-1",
    "cachegen-3",
    "int8-0-layers",
    "cachegen-3-layers",
    "packed-1",
    "packed-3",
    "packed-3-layers",
]


def reseal(blob: bytes) -> bytes:
    """Recompute the header and frame checksums of a (mutated) blob where its lengths allow."""
    data = bytearray(blob)
    try:
        pos = _FIXED.size
        pos += 1 + data[pos]
        pos += 1 + data[pos]
        (plen,) = struct.unpack_from("<H", data, pos)
        pos += 2 + plen
        if data[9] & FLAG_LAYER_SUBSET:  # the layer list (format version 3)
            (count,) = struct.unpack_from("<H", data, pos)
            pos += 2 + 2 * count
        if pos + 4 > len(data):
            return bytes(data)
        struct.pack_into("<I", data, pos, zlib.crc32(data[:pos]))
        pos += 4
        while pos + 8 <= len(data):
            (length,) = struct.unpack_from("<I", data, pos)
            end = pos + 8 + length
            if end > len(data):
                break
            struct.pack_into("<I", data, pos + 4, zlib.crc32(data[pos + 8 : end]))
            pos = end
    except (IndexError, struct.error):
        pass
    return bytes(data)


def check_decodes_or_refuses(blob: bytes) -> None:
    try:
        kv = decode(blob)
    except CodecError:
        return
    # Accepted input must be self-consistent.
    header = parse_header(blob)
    assert kv.num_tokens == header.num_tokens and kv.keys.shape[0] == header.num_layers
    inspect(blob)


mutation = st.tuples(
    st.sampled_from(NAMES),
    st.lists(
        st.tuples(st.integers(min_value=0), st.integers(min_value=1, max_value=255)),
        min_size=1,
        max_size=6,
    ),
    st.booleans(),
)


@FUZZ
@given(case=mutation)
def test_flipped_bytes_are_refused_or_consistent(blobs, case):
    name, flips, resealed = case
    data = bytearray(blobs[name])
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    assume(data != blobs[name])
    data = reseal(bytes(data)) if resealed else bytes(data)
    if not resealed:
        with pytest.raises(CodecError):
            decode(data)
    else:
        check_decodes_or_refuses(data)


@FUZZ
@given(name=st.sampled_from(NAMES), cut=st.integers(min_value=0), resealed=st.booleans())
def test_truncated_bitstreams_are_refused(blobs, name, cut, resealed):
    blob = blobs[name]
    data = blob[: cut % len(blob)]
    with pytest.raises(CodecError):
        decode(reseal(data) if resealed else data)


@FUZZ
@given(
    name=st.sampled_from(NAMES),
    pos=st.integers(min_value=0),
    junk=st.binary(min_size=1, max_size=64),
    resealed=st.booleans(),
)
def test_inserted_bytes_are_refused(blobs, name, pos, junk, resealed):
    blob = blobs[name]
    p = pos % (len(blob) + 1)
    data = blob[:p] + junk + blob[p:]
    if resealed:
        check_decodes_or_refuses(reseal(data))
    else:
        with pytest.raises(CodecError):
            decode(data)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.binary(max_size=300))
def test_random_bytes_are_refused(data):
    with pytest.raises(CodecError):
        decode(b"CGKV\x01" + data)
    with pytest.raises(CodecError):
        decode(data)


def _forge_header(blob: bytes, **fields) -> bytes:
    """The blob with header fields replaced and the header checksum fixed."""
    names = [
        "magic",
        "version",
        "codec",
        "level",
        "dtype",
        "flags",
        "layers",
        "heads",
        "head_dim",
        "start",
        "tokens",
        "chunk",
    ]
    values = dict(zip(names, _FIXED.unpack_from(blob, 0)))
    values.update(fields)
    data = bytearray(blob)
    _FIXED.pack_into(data, 0, *[values[n] for n in names])
    return reseal(bytes(data))


@pytest.mark.parametrize("name", NAMES)
def test_hostile_sizes_are_refused_before_allocating(blobs, name):
    blob = blobs[name]
    # A billion tokens, a frame per token, or a gigantic geometry: the input cannot back any
    # of these claims, so decoding stops at the size checks, before allocating the output.
    for fields in (
        {"tokens": 1 << 30},
        {"chunk": 1},
        {"layers": 60000, "heads": 250},
        {"head_dim": 4096},
        {"tokens": 0},
    ):
        with pytest.raises(CodecError):
            decode(_forge_header(blob, **fields))


def test_cachegen_stream_too_short_for_its_symbols_is_refused(blobs):
    """A re-sealed frame whose streams were emptied cannot claim to hold the chunk's symbols."""
    blob = blobs["cachegen-3"]
    kv = decode(blob)
    header = parse_header(blob)
    # replace every frame by token ids + scales + a directory of 16-word (state-only) streams
    from cachegen.codec.api import _open

    _, _, frames, decoder = _open(blob)
    out = bytearray(blob[: header.size])
    for frame in frames:
        words, dir_end = decoder._directory(frame)
        scale_bytes = dir_end - 4 * len(words)
        body = (
            bytes(frame.body[:scale_bytes])
            + struct.pack(f"<{len(words)}I", *([16] * len(words)))
            + bytes(32 * len(words))
        )
        payload = frame.token_ids.astype("<u2").tobytes() + body
        out += struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    assert kv.num_tokens == header.num_tokens
    with pytest.raises(CodecError, match="shorter than its symbols"):
        decode(bytes(out))


def test_valid_bitstreams_survive_the_reseal_helper(blobs):
    for blob in blobs.values():
        assert reseal(blob) == blob
        assert isinstance(decode(blob), KVCache)


def test_out_dtype_is_checked(blobs):
    with pytest.raises(CodecError):
        decode(blobs["raw-0"], out_dtype=torch.int8)


def _relist(blob: bytes, layer_list: bytes) -> bytes:
    """A layer-subset blob with its layer list replaced and the header checksum fixed."""
    header = parse_header(blob)
    assert header.layers is not None
    end = header.size - 4 - 2 - 2 * len(header.layers)
    head = blob[:end] + layer_list
    return head + struct.pack("<I", zlib.crc32(head)) + blob[header.size :]


@pytest.mark.parametrize("name", ["int8-0-layers", "cachegen-3-layers"])
def test_forged_layer_lists_are_refused_before_allocating(blobs, name):
    blob = blobs[name]
    assert _relist(blob, struct.pack("<3H", 2, 1, 3)) == blob
    for layers in ([], [0, 4], [3, 1], [1, 1], [0, 1, 2, 3, 0], [1] * 40000):
        forged = _relist(blob, struct.pack(f"<H{len(layers)}H", len(layers), *layers))
        with pytest.raises(CodecError, match="layer list"):
            parse_header(forged)
        with pytest.raises(CodecError):
            decode(forged)
    # a count larger than the list, or a list cut short
    with pytest.raises(CodecError):
        decode(_relist(blob, struct.pack("<3H", 60000, 1, 3)))
    with pytest.raises(CodecError, match="truncated"):
        decode(_relist(blob, struct.pack("<3H", 2, 1, 3))[: parse_header(blob).size - 5])
    # more layers than the frames hold: refused by the body size checks
    with pytest.raises(CodecError, match="corrupt"):
        decode(_relist(blob, struct.pack("<4H", 3, 0, 1, 3)))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    name=st.sampled_from(["int8-0-layers", "cachegen-3-layers"]),
    layers=st.lists(st.integers(min_value=0, max_value=0xFFFF), max_size=8),
    count=st.one_of(st.none(), st.integers(min_value=0, max_value=0xFFFF)),
)
def test_random_layer_lists_are_refused_or_consistent(blobs, name, layers, count):
    n = len(layers) if count is None else count
    data = _relist(blobs[name], struct.pack(f"<H{len(layers)}H", n, *layers))
    check_decodes_or_refuses(reseal(data))


# ---- the packed form ------------------------------------------------------------------------


def _rewrite_bodies(blob: bytes, change) -> bytes:
    """The blob with ``change(index, body) -> body`` applied to every frame body, resealed."""
    from cachegen.codec.api import _open

    header, _, frames, _ = _open(blob)
    out = bytearray(blob[: header.size])
    for frame in frames:
        ids = frame.token_ids.astype("<u2").tobytes()
        payload = ids + change(frame.index, bytes(frame.body))
        out += struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    return bytes(out)


def _packed_parts(blob: bytes):
    """(widths offset, data offset, stream byte offsets) of frame 0's body."""
    from cachegen.codec.api import _open

    _, _, frames, decoder = _open(blob)
    offsets, data_at = decoder._sections(frames[0])
    return data_at - decoder.num_streams, data_at, offsets


@pytest.mark.parametrize("name", ["packed-1", "packed-3", "packed-3-layers"])
def test_packed_frames_that_disagree_with_their_header_are_refused(blobs, name):
    blob = blobs[name]
    widths_at, data_at, offsets = _packed_parts(blob)
    assert _rewrite_bodies(blob, lambda i, b: b) == blob

    def wider(i, body):  # one stream claims a width one bit larger
        return body[:widths_at] + bytes([body[widths_at] + 1]) + body[widths_at + 1 :]

    with pytest.raises(CodecError, match="widths disagree"):
        decode(_rewrite_bodies(blob, wider))
    for cut in (1, 2, data_at // 2):  # bodies shorter or longer than the header implies
        with pytest.raises(CodecError, match="corrupt"):
            decode(_rewrite_bodies(blob, lambda i, b, cut=cut: b[:-cut]))
    with pytest.raises(CodecError, match="header implies"):
        decode(_rewrite_bodies(blob, lambda i, b: b + b"\0"))
    # an unsealed flip anywhere in a packed body fails the frame checksum
    data = bytearray(blob)
    data[-3] ^= 0x10
    with pytest.raises(CodecError, match="checksum"):
        decode(bytes(data))


def test_packed_symbols_outside_the_alphabet_are_refused(blobs):
    """Level 1's widths hold one value more than its alphabet (e.g. 15 of 4 bits, 14 the
    largest symbol): all-ones bits are a symbol no encoder writes."""
    blob = blobs["packed-1"]
    _, data_at, offsets = _packed_parts(blob)

    def ones(i, body):
        return body[:data_at] + b"\xff" * 8 + body[data_at + 8 :]

    with pytest.raises(CodecError, match="do not decode cleanly"):
        decode(_rewrite_bodies(blob, ones))


def test_packed_flag_is_refused_where_it_cannot_be(blobs):
    """The packed flag in a format version below 4, or on a baseline codec's stream."""
    packed = blobs["packed-3"]
    with pytest.raises(CodecError, match="packed symbols in a format version 3"):
        decode(_forge_header(packed, version=3))
    with pytest.raises(CodecError, match="version 8 is not supported.*upgrade"):
        decode(_forge_header(packed, version=8))
    int8 = blobs["int8-0"]
    flags = _FIXED.unpack_from(int8, 0)[5]
    with pytest.raises(CodecError, match="packed symbols in a int8 stream"):
        decode(_forge_header(int8, version=4, flags=flags | FLAG_PACKED))
    # a coded stream relabelled packed, or the reverse: refused by the body checks
    coded = blobs["cachegen-3"]
    flags = _FIXED.unpack_from(coded, 0)[5]
    with pytest.raises(CodecError, match="corrupt"):
        decode(_forge_header(coded, version=4, flags=flags | FLAG_PACKED))
    flags = _FIXED.unpack_from(packed, 0)[5]
    with pytest.raises(CodecError):
        decode(_forge_header(packed, flags=flags & ~FLAG_PACKED))
