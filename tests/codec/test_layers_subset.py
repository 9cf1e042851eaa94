"""Bitstreams of a subset of a model's layers (format version 3): KVCache subsets, every codec's
round trip against the same layers of a full stream, headers, inspect, and refusals."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import zlib

import pytest
import torch

from cachegen.codec import CodecError, available_codecs, decode, get_codec, inspect
from cachegen.codec.coding.bitstream import _FIXED, FLAG_LAYER_SUBSET, parse_header
from cachegen.codec.tcq import codec as tcq
from cachegen.errors import CacheGenError, KVError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.profiles import add_level, codec_for, ensure_profile

TEXT = "\n\n".join(
    ["The quick brown fox jumps over the lazy dog. " * 8, "def f(x):\n    return x * 2\n" * 8]
)
IDENTITY = ModelIdentity(name="m", fingerprint="f" * 64, num_layers=4, num_kv_heads=2, head_dim=8)


def make_kv(tokens: int = 10, windows=None) -> KVCache:
    """Values that bfloat16 holds exactly, so the bytes do not depend on any math library."""
    shape = (IDENTITY.num_layers, IDENTITY.num_kv_heads, tokens, IDENTITY.head_dim)
    n = IDENTITY.num_layers * IDENTITY.num_kv_heads * tokens * IDENTITY.head_dim
    base = torch.arange(n, dtype=torch.float32)
    return KVCache(
        keys=((base % 251 - 125) / 64).view(shape).to(torch.bfloat16),
        values=((base * 7 % 241 - 120) / 32).view(shape).to(torch.bfloat16),
        token_ids=torch.arange(tokens, dtype=torch.int64) + 100,
        model=IDENTITY,
        windows=windows,
    )


@pytest.fixture(scope="module")
def tiny_kv(tiny_llama) -> KVCache:
    from cachegen.extract import extract_kv

    kv = extract_kv(tiny_llama, text=TEXT).slice(5, 150)  # starts mid-prompt, spans 3 frames
    assert kv.num_layers == 4 and kv.num_tokens == 145
    return kv


def same(a: KVCache, b: KVCache) -> bool:
    return torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


# ---- KVCache subsets ----------------------------------------------------------------------


def test_select_layers_keeps_the_model_and_slices_windows():
    kv = make_kv(windows=(512, None, 512, None))
    part = kv.select_layers([0, 2])
    assert part.layers == (0, 2) and part.layer_indices == (0, 2)
    assert part.num_layers == 2 and part.model == IDENTITY
    assert part.windows == (512, 512)
    assert torch.equal(part.keys, kv.keys[[0, 2]]) and torch.equal(part.values, kv.values[[0, 2]])
    assert part.summary()["layers"] == [0, 2] and "layers" not in kv.summary()
    run = kv.select_layers((1, 2))  # consecutive layers are views
    assert run.keys.data_ptr() == kv.keys[1].data_ptr()
    assert part.select_layers([2]).layers == (2,)
    # naming every layer is the full cache
    assert kv.select_layers(range(4)).layers is None
    assert KVCache(kv.keys, kv.values, kv.token_ids, IDENTITY, layers=[0, 1, 2, 3]).layers is None
    # slicing, chunking and dtype changes keep the subset
    assert part.slice(2, 7).layers == (0, 2) and part.to(torch.float32).layers == (0, 2)
    assert all(c.layers == (0, 2) for c in part.chunks(4))


@pytest.mark.parametrize(
    "layers,message",
    [
        ([], "at least one layer"),
        ([0, 4], "out of range"),
        ([-1, 2], "out of range"),
        ([2, 0], "strictly increasing"),
        ([1, 1], "strictly increasing"),
        ([0.5], "integer"),
        ([True], "integer"),
        ("01", "list of layer indices"),
    ],
)
def test_bad_layer_lists_are_refused(layers, message):
    kv = make_kv()
    with pytest.raises(KVError, match=message):
        kv.select_layers(layers)
    assert issubclass(KVError, CacheGenError)


def test_subset_geometry_is_checked():
    kv = make_kv()
    with pytest.raises(KVError, match="does not match"):
        KVCache(kv.keys[:3], kv.values[:3], kv.token_ids, IDENTITY, layers=(0, 2))
    with pytest.raises(KVError, match="not in this cache"):
        kv.select_layers([0, 2]).select_layers([1])
    with pytest.raises(KVError, match="windows"):
        KVCache(
            kv.keys[:2], kv.values[:2], kv.token_ids, IDENTITY, windows=(1, 2, 3), layers=(0, 1)
        )


def test_merge_layers_puts_subsets_back_together():
    kv = make_kv(windows=(512, None, 512, None))
    sliding, full = kv.select_layers([0, 2]), kv.select_layers([1, 3])
    merged = KVCache.merge_layers([full, sliding])  # any order of parts
    assert merged.layers is None and same(merged, kv) and merged.windows == kv.windows
    partial = KVCache.merge_layers([kv.select_layers([3]), kv.select_layers([1])])
    assert partial.layers == (1, 3) and same(partial, kv.select_layers([1, 3]))
    # a part without windows: the result does not know them
    bare = dataclasses.replace(full, windows=None)
    assert KVCache.merge_layers([sliding, bare]).windows is None
    with pytest.raises(KVError, match="more than one"):
        KVCache.merge_layers([sliding, kv.select_layers([2, 3])])
    with pytest.raises(KVError, match="different tokens"):
        KVCache.merge_layers([sliding, kv.slice(1, 10).select_layers([1, 3])])
    with pytest.raises(KVError, match="nothing|no layer"):
        KVCache.merge_layers([])


def test_concat_refuses_to_mix_layer_sets():
    kv = make_kv(12)
    parts = [c.select_layers([0, 2]) for c in kv.chunks(4)]
    joined = KVCache.concat(parts)
    assert joined.layers == (0, 2) and same(joined, kv.select_layers([0, 2]))
    with pytest.raises(KVError, match="different layers"):
        KVCache.concat([parts[0], kv.chunks(4)[1]])
    with pytest.raises(KVError, match="different layers"):
        KVCache.concat([parts[0], kv.chunks(4)[1].select_layers([1, 3])])


def test_subset_saves_and_loads(tmp_path):
    kv = make_kv(windows=(512, None, 512, None)).select_layers([1, 2])
    kv.save(tmp_path / "kv")
    back = KVCache.load(tmp_path / "kv", expect_model=IDENTITY)
    assert back.layers == (1, 2) and back.windows == (None, 512) and same(back, kv)
    make_kv().save(tmp_path / "full")  # a full cache's kv.json has no "layers"
    assert '"layers"' not in (tmp_path / "full" / "kv.json").read_text()


# ---- every codec -----------------------------------------------------------------------------


# LMCache's asym_k16_v8 serde scales a chunk's values by one float for all the layers it holds
SCALE_OVER_LAYERS = {"lmcache-asym-k16-v8"}


@pytest.mark.parametrize("name", available_codecs())
def test_subset_decodes_to_the_same_layers_of_a_full_stream(name, tiny_kv, tiny_llama):
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    full_blob = codec.encode(tiny_kv)
    # the full stream keeps its old version (tcq's coded frames refine rows, version 7), and
    # naming every layer changes nothing
    base = tcq.REFINED_BITSTREAM_VERSION if name == "tcq" else 1
    assert parse_header(full_blob).version == base and parse_header(full_blob).layers is None
    assert codec.encode(tiny_kv.select_layers(range(4))) == full_blob
    full = decode(full_blob, out_dtype=torch.float32)
    for layers in ([0, 2], [1, 2, 3], [3]):
        blob = codec.encode(tiny_kv.select_layers(layers))
        header = parse_header(blob)
        assert header.version == max(base, 3) and header.layers == tuple(layers)
        assert header.model == tiny_kv.model and header.num_layers == len(layers)
        part = decode(blob, out_dtype=torch.float32)
        assert part.layers == tuple(layers) and part.model == tiny_kv.model
        assert part.start == tiny_kv.start and torch.equal(part.token_ids, tiny_kv.token_ids)
        expected = full.select_layers(layers)
        if name in SCALE_OVER_LAYERS:  # keys are kept exactly; values' scale moves with the set
            assert torch.equal(part.keys, expected.keys), (name, layers)
            error = (part.values - expected.values).norm() / expected.values.norm()
            assert error < 0.05, (name, layers)
        else:  # bit for bit: every other codec quantizes each layer on its own
            assert same(part, expected), (name, layers)
        assert decode(blob).keys.dtype == torch.bfloat16
    # a subset of a subset is the same stream as the subset taken at once
    assert codec.encode(tiny_kv.select_layers([0, 1, 2]).select_layers([0, 2])) == codec.encode(
        tiny_kv.select_layers([0, 2])
    )


def test_subsets_merge_back_into_the_full_decode(tiny_kv, tiny_llama):
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=64)
    full = decode(codec.encode(tiny_kv))
    parts = [decode(codec.encode(tiny_kv.select_layers(ls))) for ls in ([1, 3], [0, 2])]
    merged = KVCache.merge_layers(parts)
    assert merged.layers is None and same(merged, full)
    # chunked subset streams concatenate like chunked full streams
    chunks = [decode(codec.encode(c.select_layers([0, 2]))) for c in tiny_kv.chunks(64)]
    assert same(KVCache.concat(chunks), full.select_layers([0, 2]))


@pytest.mark.parametrize(
    "change",
    [
        {"rope_theta": "per-layer", "exact_tokens": 7},
        {"hadamard": True, "group_size": 4, "rope_theta": 10000.0, "exact_tokens": 3},
        {"hadamard": True, "group_size": 4, "rope_theta": "per-layer", "key_scale": "channel"},
        {"value_scale": "token-head", "key_bins": "per-layer"},
    ],
    ids=["layer-bases", "hadamard-locality", "everything", "per-layer-bins"],
)
def test_cachegen_variants_decode_subsets_bit_for_bit(
    change, tiny_kv, tiny_llama, isolated_profiles
):
    """Per-layer settings (bins, rotary bases, table rows) follow the absolute layer index.

    All three scale kinds (token, token-head, channel) cover one layer, the Hadamard rotation
    acts on one head vector, rotary angles on one key, and every rANS stream codes one
    (layer, K/V, segment): nothing spans layers, so a subset is exact."""
    base = ensure_profile(tiny_llama).config(3)
    if change.get("rope_theta") == "per-layer":  # Gemma 3's kind: bases differ by layer
        change = {**change, "rope_theta": (10000.0, 1e6, 0.0, 10000.0)}
    if change.get("key_bins") == "per-layer":
        change = {**change, "key_bins": (32, 16, 8, 64), "value_bins": (16, 64, 32, 8)}
    cfg = dataclasses.replace(base, **change)
    add_level(tiny_llama, 11, cfg)
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=64)
    full_blob = codec.encode(tiny_kv, 11)
    assert parse_header(full_blob).version == (2 if isinstance(cfg.rope_theta, tuple) else 1)
    for out_dtype in (torch.float32, torch.bfloat16):
        full = decode(full_blob, out_dtype=out_dtype)
        for layers in ([0, 2], [1, 3], [2]):
            blob = codec.encode(tiny_kv.select_layers(layers), 11)
            assert parse_header(blob).version == 3
            part = decode(blob, out_dtype=out_dtype)
            assert same(part, full.select_layers(layers)), (layers, out_dtype)
    exact = cfg.exact_tokens - tiny_kv.start
    if exact > 0:
        part = decode(codec.encode(tiny_kv.select_layers([1, 3]), 11), out_dtype=torch.float32)
        assert torch.equal(part.keys[:, :, :exact], tiny_kv.keys[[1, 3], :, :exact].float())


def test_inspect_accounts_for_the_layers_present(tiny_kv, tiny_llama):
    for name in ("int8", "kivi2", "cachegen"):
        codec = codec_for(name, tiny_llama, chunk_tokens=64)
        full = inspect(codec.encode(tiny_kv))
        blob = codec.encode(tiny_kv.select_layers([0, 2]))
        info = inspect(blob)
        assert info["format_version"] == 3 and full["format_version"] == 1
        assert info["layer_subset"] == [0, 2] and full["layer_subset"] is None
        assert info["num_layers"] == 2 and info["model"]["num_layers"] == 4
        assert [r["layer"] for r in info["layers"]] == [0, 2]
        overhead = info["header_bytes"] + info["frame_header_bytes"] + info["token_id_bytes"]
        layer_bytes = sum(r["key_bytes"] + r["value_bytes"] for r in info["layers"])
        assert layer_bytes + overhead == pytest.approx(len(blob))
        assert info["bits_per_element"] == pytest.approx(len(blob) * 8 / (tiny_kv.num_elements / 2))
        if name == "cachegen":  # the same layer costs the same in both streams
            rows = {r["layer"]: r for r in full["layers"]}
            for row in info["layers"]:
                assert row["key_bytes"] == pytest.approx(rows[row["layer"]]["key_bytes"])
        assert info["header_bytes"] == full["header_bytes"] + 2 + 2 * 2


def test_full_streams_are_byte_for_byte_what_they_were():
    """Digests of full streams written by the code before layer subsets existed (format
    version 1); the values are exact in bfloat16, so the bytes depend on no math library."""
    kv = make_kv(40).slice(3, 40)
    golden = {
        "raw": "4a59bc6edf7108dcfe9360f9d71cfa85713531c4d331716ecfe512eec0108bbb",
        "int8": "47f4d7852d71f1a4a94f89b6d173db8f695e88d72a35a50f00110529a500355d",
        "fp8": "dd60eba510d1e9fc172da82759969e41ebd351096e320144a16d749b00af59a9",
        "kivi2": "2e14a4c0a4fc75c41ba6c0de959dad63faaf7507bb7e6c93cacc10b29ff29f80",
    }
    for name, digest in golden.items():
        blob = get_codec(name, chunk_tokens=16).encode(kv)
        assert parse_header(blob).version == 1
        assert hashlib.sha256(blob).hexdigest() == digest, name


# ---- corrupt layer lists ---------------------------------------------------------------------


def _with_layer_list(blob: bytes, layer_list: bytes, flags: int | None = None, version=None):
    """``blob`` (a subset stream) with its layer list replaced by ``layer_list`` and the
    header checksum recomputed; ``flags``/``version`` override the fixed header's."""
    header = parse_header(blob)
    fields = list(_FIXED.unpack_from(blob, 0))
    if flags is not None:
        fields[5] = flags
    if version is not None:
        fields[1] = version
    count = len(header.layers) if header.layers is not None else None
    params_end = header.size - 4 - (2 + 2 * count if count is not None else 0)
    head = bytearray(blob[:params_end])
    _FIXED.pack_into(head, 0, *fields)
    head += layer_list
    return bytes(head) + struct.pack("<I", zlib.crc32(head)) + blob[header.size :]


def _layer_list(*layers: int, count: int | None = None) -> bytes:
    return struct.pack(f"<H{len(layers)}H", len(layers) if count is None else count, *layers)


@pytest.mark.parametrize("name", ["raw", "kivi2", "cachegen"])
def test_corrupt_layer_lists_are_refused(name, tiny_kv, tiny_llama):
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    blob = codec.encode(tiny_kv.slice(0, 80).select_layers([0, 2]))
    assert _with_layer_list(blob, _layer_list(0, 2)) == blob  # the helper changes nothing else
    relabelled = _with_layer_list(blob, _layer_list(1, 3))  # well formed, other layers
    if name == "cachegen":  # layers 1 and 3 have their own tables: the streams do not decode
        with pytest.raises(CodecError, match="do not decode cleanly"):
            decode(relabelled)
    else:  # fixed layouts: only the header's checksum tells the layers apart
        assert same(decode(relabelled), decode(blob)) and decode(relabelled).layers == (1, 3)
    for layer_list, message in [
        (_layer_list(0, 4), "out of range"),
        (_layer_list(0, 65535), "out of range"),
        (_layer_list(2, 2), "strictly increasing"),
        (_layer_list(2, 0), "strictly increasing"),
        (_layer_list(), "holds 0 of"),
        (_layer_list(0, 1, 2, 3, 0), "holds 5 of"),
        (_layer_list(0, 2, count=3), "checksum|truncated"),  # count says more than is there
        (_layer_list(0, 2, count=1), "checksum|trailing|corrupt|truncated"),
        (_layer_list(0, 1, 2), "corrupt|truncated"),  # a well-formed list of other layers
    ]:
        with pytest.raises(CodecError, match=message):
            decode(_with_layer_list(blob, layer_list))
    # truncated inside the list
    header = parse_header(blob)
    for cut in (header.size - 4 - 5, header.size - 4 - 2, header.size - 4 - 1):
        with pytest.raises(CodecError, match="truncated"):
            decode(blob[:cut])
    # the flag needs format version 3; a version 3 stream of every layer is fine
    full = codec.encode(tiny_kv.slice(0, 80))
    for version in (1, 2):
        forged = _with_layer_list(blob, _layer_list(0, 2), version=version)
        with pytest.raises(CodecError, match="layer list in a format version"):
            decode(forged)
    flags = _FIXED.unpack_from(full, 0)[5]
    with pytest.raises(CodecError, match="checksum|truncated|corrupt"):
        decode(_with_layer_list(full, b"", flags=flags | FLAG_LAYER_SUBSET))
    as_v3 = _with_layer_list(full, b"", version=3)
    assert parse_header(as_v3).version == 3 and same(decode(as_v3), decode(full))
    listed = _with_layer_list(
        full, _layer_list(0, 1, 2, 3), flags=flags | FLAG_LAYER_SUBSET, version=3
    )
    assert decode(listed).layers is None and same(decode(listed), decode(full))
