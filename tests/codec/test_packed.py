"""The packed form of the cachegen levels: the coded form's symbols and scales bit-packed at a
fixed width (format version 4), decoding to the same KV bit for bit; old streams still decode."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError, QuantConfig, decode, inspect
from cachegen.codec.cachegen.codec import CacheGenCodec
from cachegen.codec.cachegen.packed import symbol_width
from cachegen.codec.coding import tables
from cachegen.codec.coding.bitstream import FLAG_PACKED, parse_header
from cachegen.kv import KVCache, ModelIdentity
from cachegen.modes import CODED, PACKED
from cachegen.profiles import add_level, codec_for, ensure_profile
from tests.support import FIXTURES

FIXTURE = FIXTURES / "cachegen-v1-tiny-llama-level3.cgkv"
# sha256 of the fixture's float32 decode (keys then values), by the code that wrote it
FIXTURE_DECODED = "71cca68a42ac553efa641fb0ece808dbb28dfa5171a7aa1784ec011eb9fc3e9d"
DTYPES = (torch.bfloat16, torch.float32, torch.float16)


@pytest.fixture(scope="module")
def tiny_kv(tiny_llama) -> KVCache:
    from cachegen.extract import extract_kv

    return extract_kv(tiny_llama, text="Packed symbols decode at memory speed. " * 30)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype.itemsize == 2 else x.view(torch.int32)


def assert_same_decode(coded: bytes, packed: bytes) -> None:
    for dtype in DTYPES:
        a, b = decode(coded, out_dtype=dtype), decode(packed, out_dtype=dtype)
        assert torch.equal(bits(a.keys), bits(b.keys)) and torch.equal(
            bits(a.values), bits(b.values)
        )
        assert torch.equal(a.token_ids, b.token_ids) and (a.start, a.layers) == (b.start, b.layers)


def test_symbol_widths_hold_each_alphabet():
    assert [symbol_width(b) for b in (4, 6, 12, 16, 24, 32, 64, 256)] == [2, 3, 4, 4, 5, 5, 6, 8]


@pytest.mark.parametrize("level", [1, 2, 3])
def test_packed_decodes_to_the_coded_forms_kv(level, tiny_kv, tiny_llama):
    part = tiny_kv.slice(7, 120)  # mid-prompt, a short last frame
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=48)
    coded, packed = codec.encode(part, level), codec.encode(part, level, form=PACKED)
    assert codec.encode(part, level, form=PACKED) == packed  # deterministic
    assert parse_header(coded).version == 1 and parse_header(coded).form == CODED
    header = parse_header(packed)
    assert header.version == 4 and header.form == PACKED and header.level == level
    assert header.params == parse_header(coded).params  # same tables id and config
    assert_same_decode(coded, packed)
    info = inspect(packed)
    assert info["form"] == PACKED and inspect(coded)["form"] == CODED
    assert info["profile_tables"] == inspect(coded)["profile_tables"]
    # every byte is accounted for: symbols at their width, plus what the coded form also has
    config = ensure_profile(tiny_llama).config(level)
    H, D = part.num_kv_heads, part.head_dim
    symbol_bytes = sum(
        -(-n * H * D * symbol_width(b) // 8)
        for n in (48, 48, 17)
        for b in config.key_bins + config.value_bins
    )
    scales = 2 * 2 * part.num_layers * part.num_tokens  # fp16, per token, K and V
    frames = 3 * (8 + 2 * part.num_layers) + 2 * part.num_tokens  # headers, widths, token ids
    assert len(packed) == header.size + frames + scales + symbol_bytes
    assert sum(r["key_bytes"] + r["value_bytes"] for r in info["layers"]) == pytest.approx(
        len(packed) - header.size - 3 * 8 - 2 * part.num_tokens
    )


@pytest.mark.parametrize(
    "change",
    [
        {"group_size": 10},
        {"hadamard": True, "key_scale": "channel", "value_scale": "token-head"},
        {"hadamard": True, "rope_theta": 10000.0, "exact_tokens": 3},
        {"hadamard": True, "group_size": 4, "rope_theta": "per-layer", "exact_tokens": 70},
        {"key_bins": 256, "value_bins": 4},
    ],
    ids=["locality", "scales", "rotary-exact", "everything", "widest-narrowest"],
)
def test_every_variant_packs_to_the_same_kv(change, tiny_kv, tiny_llama, isolated_profiles):
    base = ensure_profile(tiny_llama).config(3)
    L = base.num_layers
    if change.get("rope_theta") == "per-layer":
        change = {**change, "rope_theta": [(1e4, 1e6, 0.0)[i % 3] for i in range(L)]}
    for key in ("key_bins", "value_bins"):
        if key in change:
            change = {**change, key: (change[key],) * L}
    add_level(tiny_llama, 11, dataclasses.replace(base, **change))
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=64)
    coded, packed = codec.encode(tiny_kv, 11), codec.encode(tiny_kv, 11, form=PACKED)
    assert_same_decode(coded, packed)
    # a subset of the layers, from a later position
    part = tiny_kv.slice(40, 150).select_layers([0, 2])
    coded, packed = codec.encode(part, 11), codec.encode(part, 11, form=PACKED)
    assert parse_header(packed).version == 4 and parse_header(packed).layers == (0, 2)
    assert_same_decode(coded, packed)


@pytest.fixture(scope="module")
def odd_codec() -> CacheGenCodec:
    """head_dim 12 and widths 2 to 6: rows that do not start on a byte, symbols that straddle
    bytes, streams that end inside a byte."""
    from cachegen.codec.cachegen.profile import Profile
    from cachegen.codec.coding import rans
    from cachegen.codec.coding.tables import LevelTables, alphabets, remember

    model = ModelIdentity("odd-packed-model", "cd" * 32, num_layers=3, num_kv_heads=3, head_dim=12)
    cfg = QuantConfig((32, 16, 6), (16, 64, 4), key_scale="channel", value_scale="token-head")
    sizes = alphabets(cfg, model)
    counts = np.random.default_rng(0).integers(0, 1000, size=(sizes.size, 63))
    level_tables = LevelTables(
        "fedcba9876543210" * 2, cfg, model, rans.quantize_frequencies(counts, sizes)
    )
    remember(level_tables)
    profile = Profile(model, {1: cfg}, {1: level_tables.id}, 1, calibration={})
    return CacheGenCodec(profile=profile, chunk_tokens=16)


def odd_kv(codec: CacheGenCodec) -> KVCache:
    x = torch.randn(2, 3, 3, 37, 12, generator=torch.Generator().manual_seed(2)) * 3
    return KVCache(x[0], x[1], torch.arange(37), codec.profile.model, start=5)


def test_odd_head_dim_packs_to_the_same_kv(odd_codec):
    kv = odd_kv(odd_codec)
    assert_same_decode(odd_codec.encode(kv), odd_codec.encode(kv, form=PACKED))


def test_packed_padding_bits_must_be_zero(odd_codec):
    """A stream that ends inside a byte pads it with zero bits: one packing per symbol
    sequence. The last frame holds 5 tokens of 36 channels: 180 symbols."""
    from cachegen.codec.api import _open

    blob = odd_codec.encode(odd_kv(odd_codec), form=PACKED)
    header, _, frames, decoder = _open(blob)
    last = frames[-1]
    offsets, _ = decoder._sections(last)
    symbols = 5 * 3 * 12 * decoder.widths.astype(int)
    stream = int(np.flatnonzero(symbols % 8)[0])  # a stream with padding bits
    end = int(offsets[stream + 1]) - 1
    body = bytearray(last.body)
    body[end] |= 0x80
    payload = last.token_ids.astype("<u2").tobytes() + bytes(body)
    start = len(blob) - last.size
    forged = blob[:start] + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(CodecError, match="padding bits"):
        decode(forged)


def test_packed_needs_no_probability_tables(tiny_kv, tiny_llama, isolated_profiles):
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=64)
    coded, packed = codec.encode(tiny_kv, 2), codec.encode(tiny_kv, 2, form=PACKED)
    expected = decode(coded)
    tables.forget_cached_tables()
    for path in isolated_profiles.rglob("*.cgtab"):
        path.unlink()
    assert torch.equal(decode(packed).keys, expected.keys)
    with pytest.raises(CodecError, match="tables"):
        decode(coded)


def test_real_kv_packs_to_the_same_kv_at_about_the_bin_width(smollm2):
    from cachegen import workload
    from cachegen.extract import extract_kv

    kv = extract_kv(smollm2, text=workload.text("eval")[:2000]).slice(0, 300)
    codec = codec_for("cachegen", smollm2, chunk_tokens=256)
    for level in (2, codec.default_level):
        coded, packed = codec.encode(kv, level), codec.encode(kv, level, form=PACKED)
        assert_same_decode(coded, packed)
        config = codec.profile.config(level)
        width = np.mean([symbol_width(b) for b in config.key_bins + config.value_bins])
        bpe = inspect(packed)["bits_per_element"]
        assert width < bpe < width + 1.0  # the scales and headers cost well under a bit
        assert inspect(coded)["bits_per_element"] < bpe


@pytest.mark.parametrize("head_dim", [2, 4, 8, 64, 128, 256])
def test_decoders_hadamard_row_is_the_hadamard_product(head_dim):
    """Both forms undo the Hadamard rotation with ``qkernels.hadamard_row`` (a fast transform
    with its own rounding): exactly the matrix product where every sum is exact (small
    integers), and within float32 rounding of it elsewhere."""
    from cachegen.codec.cachegen import quant
    from cachegen.codec.cachegen.kernels import store_transformed

    matrix = quant.hadamard_matrix(head_dim).double()
    gen = torch.Generator().manual_seed(head_dim)
    exact = torch.randint(-64, 65, (3, 5, head_dim), generator=gen).float()
    rough = torch.randn(3, 5, head_dim, generator=gen) * 5
    none = np.empty((1, 1), np.float32)
    for src in (exact, rough):
        out = torch.empty_like(src)
        store_transformed(
            src.numpy(), True, none, none, False, out.numpy(), np.empty((0, 0, 0), np.uint16)
        )
        expected = (src.double() @ matrix).float()
        if src is exact and head_dim in (4, 64, 256):  # 1/sqrt(head_dim) is a power of two
            assert torch.equal(out, expected)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5 * float(src.abs().max()))


@pytest.mark.parametrize("level", [2, 4, 6])
def test_frames_decoded_together_are_the_frames_decoded_one_by_one(level, smollm2):
    """``decode`` hands every frame's streams to the threads at once when the kernels write
    the output themselves: the same KV as frame by frame, bit for bit, with the rotations of
    the calibrated levels (4: Hadamard and rotary angles, 6: rotary angles) undone."""
    from cachegen import workload
    from cachegen.codec.api import _open
    from cachegen.extract import extract_kv

    kv = extract_kv(smollm2, text=workload.text("eval")[:1500]).slice(3, 203)
    codec = codec_for("cachegen", smollm2, chunk_tokens=64)
    for form in (CODED, PACKED):
        blob = codec.encode(kv, level, form=form)
        header, _, frames, decoder = _open(blob)
        for dtype in (torch.bfloat16, torch.float32):
            together = decoder.decode(frames, dtype)
            one_by_one = torch.empty_like(together)
            offset = 0
            for frame in frames:
                decoder.decode_frame(frame, one_by_one, offset)
                offset += len(frame.token_ids)
            assert torch.equal(bits(together), bits(one_by_one))


def test_unknown_form_is_refused(tiny_kv, tiny_llama):
    codec = codec_for("cachegen", tiny_llama)
    with pytest.raises(CodecError, match="has no form 'zipped'; its forms are coded, packed"):
        codec.encode(tiny_kv, 2, form="zipped")


@pytest.fixture
def fixture_tables():
    """The fixture's tables, shipped beside it: tables rebuilt from the model differ between
    CPUs (the model's bf16 kernels round differently with and without AMX)."""
    provider = tables.DirectoryTables(FIXTURES)
    tables.forget_cached_tables()
    tables.add_provider(provider)
    yield
    tables.remove_provider(provider)
    tables.forget_cached_tables()


def test_old_bitstream_still_decodes(tiny_llama, fixture_tables):
    """A version-1 stream (the form every stream had before the packed form existed) decodes
    to the values it was written with."""
    blob = FIXTURE.read_bytes()
    assert parse_header(blob).version == 1 and parse_header(blob).form == CODED
    out = decode(blob, out_dtype=torch.float32)
    assert out.num_tokens == 20 and out.start == 2
    data = torch.stack([out.keys, out.values]).contiguous().numpy().tobytes()
    assert hashlib.sha256(data).hexdigest() == FIXTURE_DECODED
    # the same KV in the packed form decodes to the same values as in the coded form
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=8)
    packed = codec.encode(out, 3, form=PACKED)
    assert packed[9] & FLAG_PACKED and parse_header(packed).version == 4
    assert_same_decode(codec.encode(out, 3), packed)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_hadamard_row_adds_in_butterfly_order(head_dim):
    """``hadamard_row`` (vector registers for the common head dims, a loop for the others)
    rounds exactly like butterflies of span 1, 2, 4, ... in float32, bit for bit: both forms
    of a level undo the rotation with it."""
    import numba

    from cachegen.codec.cachegen.kernels import hadamard_row

    @numba.njit
    def transform(rows, inv_sqrt):
        for r in range(rows.shape[0]):
            row = rows[r].copy()
            hadamard_row(row, rows.shape[1], inv_sqrt)
            rows[r] = row

    gen = np.random.default_rng(head_dim)
    x = gen.standard_normal((50, head_dim)) * np.exp(gen.standard_normal((50, head_dim)) * 4)
    x = x.astype(np.float32)
    expected = x.copy()
    span = 1
    while span < head_dim:  # numpy float32 butterflies, one stage at a time
        pairs = expected.reshape(50, head_dim // (2 * span), 2, span)
        a, b = pairs[:, :, 0].copy(), pairs[:, :, 1].copy()
        pairs[:, :, 0], pairs[:, :, 1] = a + b, a - b
        span *= 2
    inv_sqrt = np.float32(1 / np.sqrt(head_dim))
    expected *= inv_sqrt
    transform(x, inv_sqrt)
    assert np.array_equal(x.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("head_dim", [16, 128])
def test_rotated_levels_pack_to_the_same_kv_at_any_head_dim(head_dim):
    """Hadamard and rotary angles undone row by row at a head dim with vector rows (128) and
    one without (16), per-token and per-channel scales: the coded form's KV, bit for bit."""
    from cachegen.codec.cachegen.profile import Profile
    from cachegen.codec.coding import rans
    from cachegen.codec.coding.tables import LevelTables, alphabets, remember

    model = ModelIdentity(
        f"rotated-packed-{head_dim}", "ef" * 32, num_layers=2, num_kv_heads=2, head_dim=head_dim
    )
    cfg = QuantConfig(
        (32, 16), (16, 8), key_scale="token", value_scale="channel", hadamard=True,
        rope_theta=10000.0,
    )  # fmt: skip
    sizes = alphabets(cfg, model)
    counts = np.random.default_rng(1).integers(1, 1000, size=(sizes.size, 63))
    level_tables = LevelTables(
        f"{head_dim:016x}" * 2, cfg, model, rans.quantize_frequencies(counts, sizes)
    )
    remember(level_tables)
    profile = Profile(model, {1: cfg}, {1: level_tables.id}, 1, calibration={})
    codec = CacheGenCodec(profile=profile, chunk_tokens=16)
    x = torch.randn(2, 2, 2, 37, head_dim, generator=torch.Generator().manual_seed(3)) * 3
    kv = KVCache(x[0], x[1], torch.arange(37), model, start=5)
    assert_same_decode(codec.encode(kv), codec.encode(kv, form=PACKED))
