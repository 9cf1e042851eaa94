"""LMCache's CPU serdes as the lab codecs ``lmcache-fp8`` and ``lmcache-asym-k16-v8``: their
frames against LMCache's own serializers, their decoding against LMCache's own deserializers,
on SmolLM2's KV of a few hundred tokens (a full LMCache chunk and a short one), and damaged
input. LMCache's serialized forms here are raw bytes and a struct-packed blob: nothing is
unpickled.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cachegen.codec import CodecError, available_codecs, decode, get_codec, inspect
from cachegen.codec.api import RESERVED_IDS
from cachegen.codec.coding.bitstream import pack_frame, parse_frames, parse_header
from cachegen.kv import KVCache
from cachegen_lab.codecs.lmcache_peer import LMCACHE_CHUNK_TOKENS
from cachegen_lab.codecs.lmcache_serdes import byte_object, memory_object
from tests.codec.transform_support import relative_error
from tests.lab.codecs.damage_cases import (  # noqa: F401 - run here on this codec's blob
    test_flipped_byte_is_refused_by_the_frame_checksum,
    test_truncated_stream_is_refused,
)

CODECS = ["lmcache-fp8", "lmcache-asym-k16-v8"]
TEXT = "The quick brown fox jumps over the lazy dog. " * 30


def _kv_2ltd(chunk: KVCache) -> torch.Tensor:
    """The chunk as LMCache's memory object holds it: ``[2, L, n, H * D]``."""
    L, H, n, D = chunk.keys.shape
    kv = torch.stack([chunk.keys, chunk.values]).permute(0, 1, 3, 2, 4)
    return kv.reshape(2, L, n, H * D).contiguous()


def _layout(tensor: torch.Tensor):
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(shapes=[tensor.shape], dtypes=[tensor.dtype])


class Fp8Serde:
    """LMCache's fp8 serde on one KV_2LTD chunk."""

    def serialize(self, kv: torch.Tensor) -> tuple[int, bytes]:
        from lmcache.v1.distributed.serde import Fp8QuantizationSerializer

        serializer = Fp8QuantizationSerializer()
        dst = torch.zeros(serializer.estimate_serialized_size(_layout(kv)), dtype=torch.uint8)
        n = serializer.serialize(memory_object(kv, "KV_2LTD"), memory_object(dst), None)
        return n, dst[:n].numpy().tobytes()

    def deserialize(self, data: bytes, like: torch.Tensor) -> torch.Tensor:
        from lmcache.v1.distributed.serde import Fp8QuantizationDeserializer

        out = torch.empty_like(like)
        Fp8QuantizationDeserializer().deserialize(byte_object(data), memory_object(out), None)
        return out


class AsymSerde:
    """LMCache's asymmetric K16/V8 serde on the keys and values of one KV_2LTD chunk."""

    def serialize(self, kv: torch.Tensor) -> tuple[int, bytes]:
        from lmcache.v1.distributed.serde.asym_k16_v8 import AsymK16V8MultiSerializer

        serializer = AsymK16V8MultiSerializer()
        size = serializer.estimate_serialized_size((_layout(kv[0]), _layout(kv[1])))
        dst = torch.zeros(size, dtype=torch.uint8)
        src = (memory_object(kv[0]), memory_object(kv[1]))
        n = serializer.serialize(src, memory_object(dst), None)
        return n, dst[:n].numpy().tobytes()

    def deserialize(self, data: bytes, like: torch.Tensor) -> torch.Tensor:
        from lmcache.v1.distributed.serde.asym_k16_v8 import AsymK16V8MultiDeserializer

        keys, values = torch.empty_like(like[0]), torch.empty_like(like[1])
        dst = (memory_object(keys), memory_object(values))
        AsymK16V8MultiDeserializer().deserialize(byte_object(data), dst, None)
        return torch.stack([keys, values])


SERDES = {"lmcache-fp8": Fp8Serde(), "lmcache-asym-k16-v8": AsymSerde()}


@pytest.fixture(scope="module")
def kv(smollm2) -> KVCache:
    from cachegen.extract import extract_kv

    return extract_kv(smollm2, text=TEXT)


@pytest.fixture(scope="module", params=CODECS)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def blob(kv, name) -> bytes:
    return get_codec(name).encode(kv)


@pytest.fixture(scope="module")
def lmcache_chunks(kv, name) -> list[tuple[int, bytes, torch.Tensor]]:
    """Per chunk: the length LMCache's serializer reports, its bytes, and what LMCache's
    deserializer returns for them."""
    serde, out = SERDES[name], []
    for chunk in kv.chunks(LMCACHE_CHUNK_TOKENS):
        kv_2ltd = _kv_2ltd(chunk)
        n, data = serde.serialize(kv_2ltd)
        out.append((n, data, serde.deserialize(data, kv_2ltd)))
    return out


def test_the_codecs_are_registered_under_their_reserved_ids():
    assert set(CODECS) <= set(available_codecs())
    assert {get_codec(name).codec_id: name for name in CODECS} == {
        21: RESERVED_IDS[21],
        22: RESERVED_IDS[22],
    }


def test_frames_are_exactly_lmcaches_serialized_chunks(blob, lmcache_chunks):
    frames = parse_frames(blob, parse_header(blob))
    assert len(frames) == len(lmcache_chunks) == 2  # a full chunk and a short one
    for frame, (n, data, _) in zip(frames, lmcache_chunks, strict=True):
        assert len(frame.body) == n
        assert bytes(frame.body) == data


def test_decode_is_bit_identical_to_lmcaches_deserializer(blob, kv, lmcache_chunks):
    out = decode(blob, out_dtype=kv.dtype)
    for chunk, (_, _, expected) in zip(out.chunks(LMCACHE_CHUNK_TOKENS), lmcache_chunks):
        assert expected.dtype == kv.dtype
        assert torch.equal(_kv_2ltd(chunk), expected)


def test_round_trip_is_lossy_with_a_small_error(blob, kv, name):
    out = decode(blob, out_dtype=torch.float32)
    assert torch.equal(out.token_ids, kv.token_ids)
    assert 0 < relative_error(out, kv) < 0.05
    if name == "lmcache-asym-k16-v8":  # keys stored in the KV's dtype
        assert torch.equal(out.keys.to(kv.dtype), kv.keys)


def test_inspect_counts_every_byte_and_attributes_the_bodies_to_layers(blob, kv):
    info = inspect(blob)
    assert info["bits_per_element"] == pytest.approx(len(blob) * 8 / kv.num_elements)
    bodies = sum(len(frame.body) for frame in parse_frames(blob, parse_header(blob)))
    layers = sum(row["key_bytes"] + row["value_bytes"] for row in info["layers"])
    assert layers == pytest.approx(bodies)


def _restream(blob: bytes, kv: KVCache, body: bytes) -> bytes:
    """``blob`` with frame 0's body replaced by ``body``, checksums recomputed: only the
    codec's own checks (and LMCache's) can refuse it."""
    header = parse_header(blob)
    frames = parse_frames(blob, header)
    bodies = [body] + [bytes(f.body) for f in frames[1:]]
    chunks = kv.chunks(LMCACHE_CHUNK_TOKENS)
    packed = [pack_frame(c.token_ids, header.token_width, b) for c, b in zip(chunks, bodies)]
    return bytes(blob[: header.size]) + b"".join(packed)


def _first_body(blob: bytes) -> bytearray:
    return bytearray(parse_frames(blob, parse_header(blob))[0].body)


@pytest.mark.parametrize("damage", [lambda b: b[:-1], lambda b: b[:100], lambda b: b + b"\0"])
def test_a_body_of_the_wrong_size_is_refused(blob, kv, damage):
    with pytest.raises(CodecError, match="corrupt"):
        decode(_restream(blob, kv, bytes(damage(_first_body(blob)))))


def _flip(body: bytearray, at: int) -> bytes:
    body[at] ^= 0x40
    return bytes(body)


@pytest.mark.parametrize(
    ("at", "message"),
    [(0, "bad magic"), (12, "unknown dtype index"), (-2, "payload CRC mismatch")],
    ids=["magic", "key-dtype", "payload"],
)
def test_a_forged_asym_blob_is_refused_by_lmcaches_checks(kv, at, message):
    blob = get_codec("lmcache-asym-k16-v8").encode(kv)
    with pytest.raises(CodecError, match=message):
        decode(_restream(blob, kv, _flip(_first_body(blob), at)))


def test_an_asym_blob_of_another_dtype_is_refused(kv):
    codec = get_codec("lmcache-asym-k16-v8")
    blob = codec.encode(kv)
    half = dataclasses.replace(kv, keys=kv.keys.half(), values=kv.values.half())
    other = _first_body(codec.encode(half))
    with pytest.raises(CodecError, match="blob layout"):
        decode(_restream(blob, kv, bytes(other)))


def test_the_codec_report_measures_every_peer_beside_the_baselines(kv):
    from cachegen_lab.bench.codec_report import BASELINES, reference_rows
    from cachegen_lab.codecs import PEER_CODECS

    short = kv.slice(0, 32)  # one bitstream of one frame per codec, to keep the test quick
    rows = {name: sizes for name, _, _, sizes in reference_rows([short], LMCACHE_CHUNK_TOKENS)}
    assert list(rows) == [*BASELINES, *PEER_CODECS]
    for name in PEER_CODECS:
        assert rows[name]["bytes"] == len(get_codec(name).encode(short))
    assert rows["lmcache-fp8"]["bits_per_element"] == pytest.approx(8, rel=0.05)
