"""LMCache's CacheGen as the lab codec ``lmcache-cachegen``: its frames against LMCache's own
v1 serializer and deserializer, LMCache's bins, a lossy round trip and damaged input.

LMCache's serializer classes are built here with only the fields they read (``chunk_size``;
``model_name``, ``kv_shape``, ``kv_dtype``). Their bytes are a pickle: the test reads back
the bytes LMCache's serializer has just made in this process, as LMCache's deserializer
does, to have LMCache's own decoding to compare with; the codec never unpickles anything.
"""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from cachegen.codec import CodecError, available_codecs, decode, get_codec, inspect
from cachegen.codec.coding.bitstream import pack_frame, pack_header, parse_frames, parse_header
from cachegen.kv import KVCache
from cachegen_lab.codecs.lmcache_peer import (
    LMCACHE_CHUNK_TOKENS,
    LMCacheCacheGenCodec,
    body_of,
    lmcache_bins,
    lmcache_model_name,
)
from tests.codec.transform_support import relative_error
from tests.lab.codecs.damage_cases import (  # noqa: F401 - run here on this codec's blob
    test_flipped_byte_is_refused_by_the_frame_checksum,
    test_truncated_stream_is_refused,
)

# pickle's framing of one chunk: class, field and tensor-type names, shapes; no KV data
PICKLE_FRAMING_BYTES = 4096


def _kv_2ltd(chunk: KVCache) -> torch.Tensor:
    """The chunk as LMCache's memory object holds it: ``[2, L, n, H * D]``."""
    L, H, n, D = chunk.keys.shape
    return torch.stack([chunk.keys, chunk.values]).permute(0, 1, 3, 2, 4).reshape(2, L, n, H * D)


@pytest.fixture(scope="module")
def blob(kv) -> bytes:
    return get_codec("lmcache-cachegen").encode(kv)


@pytest.fixture(scope="module")
def lmcache_chunks(kv, tiny_llama) -> list[tuple[bytes, torch.Tensor]]:
    """Per chunk: LMCache's serialized bytes and what its deserializer returns for them."""
    from lmcache.v1.storage_backend.naive_serde.cachegen_decoder import CacheGenDeserializer
    from lmcache.v1.storage_backend.naive_serde.cachegen_encoder import CacheGenSerializer

    L, H, _, D = kv.keys.shape
    config = SimpleNamespace(chunk_size=LMCACHE_CHUNK_TOKENS)
    name = lmcache_model_name(tiny_llama)
    shape = (L, 2, LMCACHE_CHUNK_TOKENS, H, D)
    serializer = CacheGenSerializer(config, SimpleNamespace(model_name=name, kv_shape=shape))
    deserializer = CacheGenDeserializer(config, SimpleNamespace(model_name=name, kv_dtype=kv.dtype))
    out = []
    for chunk in kv.chunks(LMCACHE_CHUNK_TOKENS):
        memory = SimpleNamespace(tensor=_kv_2ltd(chunk), parent=lambda: None)
        data = bytes(serializer.serialize(memory).byte_array)
        decoded = deserializer.deserialize(SimpleNamespace(byte_array=data)).tensor
        out.append((data, decoded))
    return out


def test_the_codec_is_registered():
    assert "lmcache-cachegen" in available_codecs()


def test_frames_hold_exactly_the_tensors_of_lmcaches_serialized_chunks(blob, kv, lmcache_chunks):
    from lmcache.storage_backend.serde.cachegen_basics import CacheGenGPUEncoderOutput

    frames = parse_frames(blob, parse_header(blob))
    assert len(frames) == len(lmcache_chunks) == 2  # a full chunk and a short one
    for frame, (data, _) in zip(frames, lmcache_chunks, strict=True):
        output = CacheGenGPUEncoderOutput.from_bytes(data)
        assert bytes(frame.body) == body_of(output)
        tensors = (
            output.cdf,
            output.max_tensors_key,
            output.max_tensors_value,
            output.data_chunks[0].bytestream,
            output.data_chunks[0].bytestream_lengths,
        )
        assert len(frame.body) == sum(t.numel() * t.element_size() for t in tensors)
        assert 0 < len(data) - len(frame.body) < PICKLE_FRAMING_BYTES


def test_decode_is_bit_identical_to_lmcaches_deserializer(blob, kv, lmcache_chunks):
    out = decode(blob, out_dtype=kv.dtype)
    for chunk, (_, expected) in zip(out.chunks(LMCACHE_CHUNK_TOKENS), lmcache_chunks, strict=True):
        assert expected.dtype == kv.dtype
        assert torch.equal(_kv_2ltd(chunk), expected)


def test_round_trip_is_lossy_with_a_small_error(blob, kv):
    out = decode(blob, out_dtype=torch.float32)
    assert out.keys.shape == kv.keys.shape and out.values.shape == kv.values.shape
    assert torch.equal(out.token_ids, kv.token_ids)
    assert 0 < relative_error(out, kv) < 0.1


def test_inspect_counts_every_byte_and_attributes_the_bodies_to_layers(blob, kv):
    info = inspect(blob)
    assert info["bits_per_element"] == pytest.approx(len(blob) * 8 / kv.num_elements)
    frames = parse_frames(blob, parse_header(blob))
    bodies = sum(len(frame.body) for frame in frames)
    assert sum(row["key_bytes"] + row["value_bytes"] for row in info["layers"]) == bodies


def test_bins_are_lmcaches_choice_for_the_model(blob, kv, smollm2):
    # tiny-llama (4 layers): LMCache's default for fewer than 10 layers, 32 bins everywhere
    assert parse_header(blob).params == bytes([32] * 2 * kv.num_layers)
    keys, values = lmcache_bins(lmcache_model_name(smollm2), 30)
    assert keys == (32,) * 10 + (16,) * 20 and values == (32,) * 2 + (16,) * 28
    listed = lmcache_bins("meta-llama/Llama-3.1-8B-Instruct", 32)  # a model LMCache lists
    assert listed == ((32,) * 10 + (16,) * 22, (32,) * 2 + (16,) * 30)
    with pytest.raises(CodecError, match="for 32 layers; the KV has 30"):
        lmcache_bins("meta-llama/Llama-3.1-8B-Instruct", 30)


def test_chunks_beyond_one_lmcache_bytestream_are_refused():
    with pytest.raises(CodecError, match="chunk_tokens must be in 1..256"):
        LMCacheCacheGenCodec(chunk_tokens=512)


def test_a_layer_subset_whose_key_and_value_bins_differ_is_refused(smollm2):
    from cachegen.extract import extract_kv

    kv = extract_kv(smollm2, text="A short text for two layers. " * 4)
    codec = get_codec("lmcache-cachegen")
    assert parse_header(codec.encode(kv.select_layers([12, 13]))).params == bytes([16] * 4)
    with pytest.raises(CodecError, match="keys have up to 32 bins and their values 16"):
        codec.encode(kv.select_layers([5]))


def _restream(blob: bytes, kv: KVCache, damage) -> bytes:
    """``blob`` with frame 0's body replaced by ``damage(body)``, checksums recomputed: only
    the codec's own checks can refuse it."""
    header = parse_header(blob)
    frames = parse_frames(blob, header)
    chunks = kv.chunks(LMCACHE_CHUNK_TOKENS)
    bodies = [damage(bytearray(frames[0].body))] + [bytes(f.body) for f in frames[1:]]
    packed = [pack_frame(c.token_ids, header.token_width, b) for c, b in zip(chunks, bodies)]
    return bytes(blob[: header.size]) + b"".join(packed)


def _set_first_length(body: bytearray, value: int) -> bytes:
    struct.pack_into("<i", body, 0, value)
    return bytes(body)


def _flatten_first_cdf(body: bytearray, kv: KVCache) -> bytes:
    lengths = 4 * 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim
    struct.pack_into("<hh", body, lengths + 2, 7, 7)  # cdf[0, 0, 1:3]: not increasing
    return bytes(body)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda body, kv: bytes(body[:-1]), "body is"),
        (lambda body, kv: bytes(body[:100]), "body is"),
        (lambda body, kv: _set_first_length(body, -5), "body is|code lengths"),
        (lambda body, kv: _set_first_length(body, 300), "body is|code lengths"),
        (_flatten_first_cdf, "CDFs"),
    ],
    ids=["one-byte-short", "cut", "negative-length", "long-length", "cdf"],
)
def test_forged_frame_with_a_valid_checksum_is_refused(blob, kv, damage, message):
    with pytest.raises(CodecError, match=message):
        decode(_restream(blob, kv, lambda body: damage(body, kv)))


@pytest.mark.parametrize(
    "params", [b"", bytes([32] * 7), bytes([2] * 8), bytes([16] * 4 + [32] * 4)]
)
def test_corrupt_bins_in_the_header_are_refused(blob, kv, params):
    header, width = pack_header(LMCacheCacheGenCodec.codec_id, 0, kv, LMCACHE_CHUNK_TOKENS, params)
    frames = parse_frames(blob, parse_header(blob))
    chunks = kv.chunks(LMCACHE_CHUNK_TOKENS)
    stream = header + b"".join(
        pack_frame(c.token_ids, width, f.body) for c, f in zip(chunks, frames)
    )
    with pytest.raises(CodecError, match="corrupt \\(bins\\)"):
        decode(stream)
