"""The codec: round trips of every codec, bounds on lossy error, determinism, profiles, inspect."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch

from cachegen.codec import (
    CodecError,
    QuantConfig,
    available_codecs,
    decode,
    get_codec,
    inspect,
    load_profile,
    paper_levels,
)
from cachegen.codec.cachegen import quant
from cachegen.codec.coding import tables as tables_mod
from cachegen.codec.coding.bitstream import parse_frames, parse_header, read_token_ids
from cachegen.codec.transform import rotary
from cachegen.errors import CacheGenError
from cachegen.kv import KVCache
from cachegen.profiles import add_level, codec_for, ensure_profile
from tests.worker_threads import torch_on_own_cores

TEXT = "\n\n".join(
    ["The quick brown fox jumps over the lazy dog. " * 12, "def f(x):\n    return x * 2\n" * 12]
)


@pytest.fixture(scope="session")
def tiny_kv(tiny_llama) -> KVCache:
    from cachegen.extract import extract_kv

    kv = extract_kv(tiny_llama, text=TEXT)
    assert 200 < kv.num_tokens < 400
    return kv


@pytest.fixture(scope="session")
def tiny_profile(tiny_llama):
    return ensure_profile(tiny_llama)


def codec_levels():
    levels = {"cachegen": [1, 2, 3], "kvtc": [10, 40], "turboquant": [25, 35], "tcq": [20, 26]}
    for name in available_codecs():
        for level in levels.get(name, [0]):
            yield name, level


def f32(kv: KVCache) -> torch.Tensor:
    return torch.stack([kv.keys, kv.values]).to(torch.float32)


def test_required_codecs_are_available():
    assert {"raw", "int8", "fp8", "int8-zstd", "kivi2", "cachegen"} <= set(available_codecs())


@pytest.mark.parametrize("name,level", list(codec_levels()))
def test_round_trip_keeps_metadata_and_is_deterministic(name, level, tiny_kv, tiny_llama):
    part = tiny_kv.slice(37, 170)  # a token range that starts mid-prompt and spans 3 frames
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    assert level in codec.levels
    blob = codec.encode(part, level)
    assert codec.encode(part, level) == blob
    out = decode(blob, out_dtype=torch.float32)
    assert out.start == 37 and out.num_tokens == part.num_tokens
    assert torch.equal(out.token_ids, part.token_ids)
    assert out.model == part.model
    assert out.keys.dtype == torch.float32 and out.keys.shape == part.keys.shape
    assert decode(blob).keys.dtype == torch.bfloat16
    info = inspect(blob)
    assert info["codec"] == name and info["level"] == level and info["num_frames"] == 3


def test_raw_is_lossless(tiny_kv):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = tiny_kv.to(dtype)
        out = decode(get_codec("raw").encode(kv), out_dtype=dtype)
        assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)


def test_int8_error_is_within_half_a_step(tiny_kv):
    x = f32(tiny_kv)
    y = f32(decode(get_codec("int8").encode(tiny_kv), out_dtype=torch.float32))
    step = x.abs().amax(dim=(2, 4), keepdim=True).to(torch.float16).float() / 127
    assert torch.all((x - y).abs() <= step / 2 * 1.001 + 1e-6)


def test_fp8_error_is_within_e4m3_precision(tiny_kv):
    x = f32(tiny_kv)
    y = f32(decode(get_codec("fp8").encode(tiny_kv), out_dtype=torch.float32))
    scale = x.abs().amax(dim=(2, 3, 4), keepdim=True) / 448
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal step 2^-9 of the scale
    assert torch.all((x - y).abs() <= x.abs() * 2**-4 + scale * 2**-9 + 1e-6)


def _step_bound(x: torch.Tensor, cfg: QuantConfig, kind: str) -> torch.Tensor:
    """Half a quantization step of each element of x [L, H, n, D] under a plain config."""
    m = torch.tensor([quant.max_level(b) for b in cfg.bins(kind)], dtype=torch.float32).view(
        -1, 1, 1, 1
    )
    amax = quant._amax(x, cfg.scale(kind)).to(torch.float16).float()
    return (amax / m / 2).expand_as(x)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_cachegen_error_is_within_half_a_step(level, tiny_kv, tiny_profile):
    cfg = tiny_profile.config(level)
    codec = codec_for("cachegen", "tiny-llama", chunk_tokens=tiny_kv.num_tokens)
    out = decode(codec.encode(tiny_kv, level), out_dtype=torch.float32)
    for kind, x, y in (
        ("k", tiny_kv.keys.float(), out.keys),
        ("v", tiny_kv.values.float(), out.values),
    ):
        assert torch.all((x - y).abs() <= _step_bound(x, cfg, kind) * 1.001 + 1e-6)


def test_bf16_output_is_the_float32_output_rounded(tiny_kv, tiny_llama):
    blob = codec_for("cachegen", tiny_llama).encode(tiny_kv)
    a, b = decode(blob, out_dtype=torch.float32), decode(blob, out_dtype=torch.bfloat16)
    assert torch.equal(a.keys.to(torch.bfloat16), b.keys) and torch.equal(
        a.values.to(torch.bfloat16), b.values
    )


def test_chunked_bitstreams_decode_like_one(tiny_kv, tiny_llama):
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=64)
    whole = decode(codec.encode(tiny_kv))
    parts = KVCache.concat([decode(codec.encode(c)) for c in tiny_kv.chunks(64)])
    assert torch.equal(whole.keys, parts.keys) and torch.equal(whole.values, parts.values)
    assert torch.equal(whole.token_ids, parts.token_ids)


def test_quantize_kernels_match_the_torch_reference():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 37, 64, generator=gen) * torch.rand(3, 2, 37, 64, generator=gen) * 9
    x[1, 0, 5] = 0  # an all-zero token
    bins = (32, 12, 256)
    for kind in quant.SCALE_KINDS:
        a, b = quant.quantize(x, bins, kind), quant.quantize_reference(x, bins, kind)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_non_finite_kv_is_refused(tiny_kv, tiny_llama):
    bad = tiny_kv.slice(0, 8).to(torch.float32)
    bad.keys[0, 0, 3, 5] = float("nan")
    with pytest.raises(CodecError, match="NaN"):
        codec_for("cachegen", tiny_llama).encode(bad)


def test_paper_presets_scale_with_depth():
    levels = paper_levels(32)
    assert levels[2].key_bins == (32,) * 10 + (16,) * 22
    assert levels[2].value_bins == (32,) * 2 + (16,) * 30
    assert (
        levels[1].key_bins == (16,) * 22 + (12,) * 10
        and levels[1].value_bins == (16,) * 2 + (12,) * 30
    )
    assert levels[3].key_bins == (32,) * 32
    assert paper_levels(30)[2].key_bins == (32,) * 10 + (16,) * 20
    assert paper_levels(4)[2].key_bins == (32, 32, 16, 16)


def test_quant_config_packs_compactly_and_round_trips():
    cfg = QuantConfig(
        paper_levels(30)[2].key_bins,
        (24,) * 30,
        key_scale="channel",
        value_scale="token-head",
        hadamard=True,
        group_size=10,
    )
    packed = cfg.pack()
    assert len(packed) < 40
    assert QuantConfig.unpack(packed) == cfg
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(CodecError):
        QuantConfig((2,), (16,))
    with pytest.raises(CodecError):
        QuantConfig((16,), (16,), key_scale="per-galaxy")
    # the rotary and exact-token options travel in an extension that older configs do not carry
    extended = dataclasses.replace(cfg, rope_theta=500000.0, exact_tokens=4)
    assert len(extended.pack()) == len(packed) + 6
    assert QuantConfig.unpack(extended.pack()) == extended
    assert QuantConfig.from_dict(extended.to_dict()) == extended
    assert "rope_theta" not in cfg.to_dict() and "exact_tokens" not in cfg.to_dict()
    for bad in ({"rope_theta": -1.0}, {"rope_theta": float("nan")}, {"exact_tokens": 70000}):
        with pytest.raises(CodecError):
            dataclasses.replace(cfg, **bad)
    with pytest.raises(CodecError, match="malformed|truncated"):
        QuantConfig.unpack(extended.pack()[:-1])
    # per-layer rotary bases (run-length coded); all-equal bases are one number
    layered = dataclasses.replace(cfg, rope_theta=(1e4, 1e4, 1e6) * (cfg.num_layers // 3))
    assert QuantConfig.unpack(layered.pack()) == layered
    assert QuantConfig.from_dict(layered.to_dict()) == layered
    assert layered.bitstream_version == 2 and extended.bitstream_version == 1
    assert dataclasses.replace(cfg, rope_theta=[7.0] * cfg.num_layers).rope_theta == 7.0
    with pytest.raises(CodecError, match="bases for"):
        dataclasses.replace(cfg, rope_theta=(1e4, 1e6))
    with pytest.raises(CodecError, match="malformed|truncated"):
        QuantConfig.unpack(layered.pack()[:-2])


def test_inspect_counts_every_byte(tiny_kv, tiny_llama):
    for name in ("int8", "cachegen", "kivi2"):
        blob = codec_for(name, tiny_llama, chunk_tokens=64).encode(tiny_kv)
        info = inspect(blob)
        assert info["bytes"] == len(blob)
        assert info["bits_per_element"] == pytest.approx(len(blob) * 8 / tiny_kv.num_elements)
        assert info["ratio_vs_fp16"] == pytest.approx(tiny_kv.num_elements * 2 / len(blob))
        layer_bytes = sum(r["key_bytes"] + r["value_bytes"] for r in info["layers"])
        overhead = info["header_bytes"] + info["frame_header_bytes"] + info["token_id_bytes"]
        assert layer_bytes + overhead == pytest.approx(len(blob))
        assert len(info["layers"]) == tiny_kv.num_layers
    assert inspect(get_codec("int8").encode(tiny_kv))["ratio_vs_int8"] == pytest.approx(1.0)


def test_header_is_small(tiny_kv, tiny_llama):
    for name in available_codecs():
        info = inspect(codec_for(name, tiny_llama).encode(tiny_kv.slice(0, 16)))
        assert info["header_bytes"] <= 200, name


def test_token_ids_are_read_from_the_frames_alone(tiny_kv):
    """``read_token_ids``: every frame's ids, from the frame lengths and payload starts, out of
    a stream that may end right after the last frame's ids; a shorter one is refused."""
    blob = get_codec("int8", chunk_tokens=64).encode(tiny_kv)
    header = parse_header(blob)
    assert header.num_frames > 2
    ids = tiny_kv.token_ids.tolist()
    assert read_token_ids(blob, header).tolist() == ids
    last = parse_frames(blob, header)[-1]
    end = len(blob) - last.size + 8 + header.frame_tokens(last.index) * header.token_width
    assert read_token_ids(blob[:end], header).tolist() == ids
    with pytest.raises(CodecError, match="ends before the token ids of frame"):
        read_token_ids(blob[: end - 1], header)


def test_empty_token_range_round_trips(tiny_kv, tiny_llama):
    blob = codec_for("cachegen", tiny_llama).encode(tiny_kv.slice(5, 5))
    out = decode(blob)
    assert out.num_tokens == 0 and out.start == 5
    assert inspect(blob)["bits_per_element"] is None


def test_unknown_codec_and_level_are_refused(tiny_kv, tiny_llama):
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("zip")
    with pytest.raises(CodecError, match="no level"):
        codec_for("cachegen", tiny_llama).encode(tiny_kv, level=9)
    with pytest.raises(CodecError):
        get_codec("raw", chunk_tokens=0)
    assert issubclass(CodecError, CacheGenError)


# ---- profiles --------------------------------------------------------------------------------


def test_profile_build_is_deterministic_and_content_addressed(
    isolated_profiles, tiny_llama, tiny_profile
):
    with pytest.raises(CodecError, match="cachegen profile build --model tiny-llama"):
        load_profile(tiny_llama)  # the codec reads profiles, it never builds one
    fresh = ensure_profile(tiny_llama)
    assert load_profile(tiny_llama) == fresh
    assert fresh.id == tiny_profile.id
    assert fresh.tables_ids == tiny_profile.tables_ids
    for tables_id in fresh.tables_ids.values():
        assert (isolated_profiles / "tables" / f"{tables_id}.cgtab").is_file()
    assert sorted(fresh.levels) == [1, 2, 3] and fresh.default_level == 2


def test_decoder_never_builds_tables_and_ensure_profile_rebuilds_them(
    tiny_kv, tiny_llama, tiny_profile, isolated_profiles
):
    blob = codec_for("cachegen", tiny_llama).encode(tiny_kv, 3)
    expected = decode(blob)
    shutil.rmtree(isolated_profiles)  # a consumer machine with the model but no profile
    tables_mod.forget_cached_tables()
    with pytest.raises(CodecError, match="cachegen profile build --model tiny-llama"):
        decode(blob)
    ensure_profile(tiny_llama)  # above the codec: rebuilds from the model, identical ids
    out = decode(blob)
    assert torch.equal(out.keys, expected.keys) and torch.equal(out.values, expected.values)
    assert (isolated_profiles / "tables" / f"{tiny_profile.tables_ids[3]}.cgtab").is_file()
    path = isolated_profiles / "tables" / f"{tiny_profile.tables_ids[2]}.cgtab"
    path.unlink()  # a profile whose tables went missing is repaired the same way
    tables_mod.forget_cached_tables()
    ensure_profile(tiny_llama)
    assert path.is_file()


def test_decode_needs_only_the_tables_not_the_model(tiny_kv, tiny_llama, tmp_path):
    """A process whose cache holds the tables and no model weights decodes; without the
    tables it fails with a CodecError that says where to get them, and loads no model."""
    import json
    import subprocess
    import sys

    blob = codec_for("cachegen", tiny_llama).encode(tiny_kv, 2)
    (tmp_path / "in.cg").write_bytes(blob)
    tables_id = inspect(blob)["profile_tables"]
    probe = (
        "import json, sys\n"
        "from cachegen.codec import decode\n"
        "from cachegen.errors import CacheGenError\n"
        "try:\n"
        "    kv = decode(open(sys.argv[1], 'rb').read()); result = {'tokens': kv.num_tokens}\n"
        "except CacheGenError as exc:\n"
        "    result = {'error': str(exc)}\n"
        "result['loaded'] = sorted(m for m in ('transformers', 'cachegen.extract', "
        "'cachegen.profiles') if m in sys.modules)\n"
        "print(json.dumps(result))\n"
    )

    def run(cache_dir):
        env = {"PATH": "/usr/bin:/bin", "CACHEGEN_CACHE_DIR": str(cache_dir), "HOME": str(tmp_path)}
        out = subprocess.run(
            [sys.executable, "-c", probe, str(tmp_path / "in.cg")],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    with_tables = tmp_path / "consumer"
    source = tables_mod.LOCAL.path(tables_id)
    (with_tables / "profiles" / "tables").mkdir(parents=True)
    shutil.copy(source, with_tables / "profiles" / "tables" / source.name)
    assert run(with_tables) == {"tokens": tiny_kv.num_tokens, "loaded": []}
    missing = run(tmp_path / "empty")
    assert missing["loaded"] == []
    assert "cachegen profile build --model tiny-llama" in missing["error"]
    assert str(tmp_path / "empty" / "profiles" / "tables") in missing["error"]


def test_decoder_says_how_to_get_tables_it_does_not_have(tiny_kv, tiny_llama, isolated_profiles):
    from cachegen.codec.cachegen.codec import CacheGenCodec

    # KV that claims to come from a model this machine does not have
    stranger = dataclasses.replace(tiny_kv.model, name="no-such-model")
    kv = KVCache(tiny_kv.keys, tiny_kv.values, tiny_kv.token_ids, stranger)
    blob = CacheGenCodec(profile=ensure_profile(tiny_llama)).encode(kv)
    shutil.rmtree(isolated_profiles)
    tables_mod.forget_cached_tables()
    with pytest.raises(CodecError, match="profile build --model no-such-model"):
        decode(blob)


def test_corrupt_tables_file_is_detected(tiny_kv, tiny_llama, isolated_profiles):
    blob = codec_for("cachegen", tiny_llama).encode(tiny_kv)
    tables_id = inspect(blob)["profile_tables"]
    path = isolated_profiles / "tables" / f"{tables_id}.cgtab"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    tables_mod.forget_cached_tables()
    with pytest.raises(CodecError, match="corrupt"):
        decode(blob)


def test_add_level_persists_and_becomes_usable(tiny_kv, tiny_llama, isolated_profiles):
    old_id = ensure_profile(tiny_llama).id
    base = load_profile(tiny_llama).config(2)
    calibrated = dataclasses.replace(
        base, key_scale="channel", value_scale="token-head", description="calibrated"
    )
    profile = add_level(tiny_llama, 7, calibrated, make_default=True)
    assert profile.id != old_id
    again = load_profile(tiny_llama)
    assert (
        again.default_level == 7
        and again.config(7) == calibrated
        and again.config(7).description == "calibrated"
    )
    codec = codec_for("cachegen", tiny_llama)
    assert codec.levels == [1, 2, 3, 7] and codec.default_level == 7
    out = decode(codec.encode(tiny_kv), out_dtype=torch.float32)
    for kind, x, y in (
        ("k", tiny_kv.keys.float(), out.keys),
        ("v", tiny_kv.values.float(), out.values),
    ):
        assert torch.all(
            (x - y).abs()
            <= _step_bound_chunked(x, calibrated, kind, codec.chunk_tokens) * 1.001 + 1e-6
        )
    again.set_default_level(2)
    again.remove_level(7)
    assert sorted(load_profile(tiny_llama).levels) == [1, 2, 3]
    with pytest.raises(CodecError):
        again.set_default_level(42)


def _step_bound_chunked(x, cfg, kind, chunk_tokens):
    return torch.cat(
        [
            _step_bound(x[:, :, b : b + chunk_tokens], cfg, kind)
            for b in range(0, x.shape[2], chunk_tokens)
        ],
        2,
    )


@pytest.mark.parametrize(
    "change",
    [
        {"group_size": 10},
        {"hadamard": True},
        {"hadamard": True, "group_size": 4, "key_scale": "channel"},
        {"rope_theta": 10000.0},
        {"hadamard": True, "rope_theta": 10000.0, "exact_tokens": 3, "value_scale": "token-head"},
        {"hadamard": True, "group_size": 4, "rope_theta": 10000.0, "exact_tokens": 150},
        {"rope_theta": "per-layer", "exact_tokens": 1},
        {"hadamard": True, "group_size": 4, "rope_theta": "per-layer"},
    ],
    ids=[
        "locality",
        "hadamard",
        "all-old",
        "rotary",
        "rotary-hadamard-exact",
        "everything",
        "layer-bases",
        "layer-bases-locality",
    ],
)
def test_variants_round_trip_within_their_step(change, tiny_kv, tiny_llama, isolated_profiles):
    base = ensure_profile(tiny_llama).config(3)
    if change.get("rope_theta") == "per-layer":  # Gemma 3's kind: bases differ by layer
        bases = [10000.0, 1e6, 0.0]
        change = {**change, "rope_theta": [bases[i % 3] for i in range(base.num_layers)]}
    cfg = dataclasses.replace(base, **change)
    add_level(tiny_llama, 11, cfg)
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=100)
    blob = codec.encode(tiny_kv, 11)
    # the stream says which format it needs: per-layer bases are version 2, the rest 1
    assert parse_header(blob).version == (2 if isinstance(cfg.rope_theta, tuple) else 1)
    assert codec.encode(tiny_kv, 11) == blob
    out = decode(blob, out_dtype=torch.float32)
    # bfloat16 output (rotated inside the decoding threads) is the float32 output, rounded;
    # float16 output takes the torch path and agrees to its precision
    assert torch.equal(decode(blob, out_dtype=torch.bfloat16).keys, out.keys.to(torch.bfloat16))
    torch.testing.assert_close(
        decode(blob, out_dtype=torch.float16).keys.float(), out.keys, rtol=2e-3, atol=2e-3
    )
    exact = cfg.exact_tokens
    assert torch.equal(out.keys[:, :, :exact], tiny_kv.keys[:, :, :exact].float())
    assert torch.equal(out.values[:, :, :exact], tiny_kv.values[:, :, :exact].float())
    plain = dataclasses.replace(cfg, hadamard=False, rope_theta=0.0, exact_tokens=0)
    for x, y, kind in (
        (tiny_kv.keys.float(), out.keys, "k"),
        (tiny_kv.values.float(), out.values, "v"),
    ):
        # Closed-loop locality: each token's error is its own segment's quantization error;
        # the orthonormal rotations (Hadamard, rotary angles) keep per-token error norms.
        per_token = (x - y).pow(2).sum(-1).sqrt()
        x_rot = (
            rotary.rotate_layer_keys(x, 0, cfg.layer_thetas, inverse=True)
            if kind == "k" and cfg.derotates
            else x
        )
        x_rot = quant.hadamard(x_rot) if cfg.hadamard else x_rot
        bound = torch.cat(
            [
                _segment_bound(x_rot[:, :, b : b + 100], plain, kind)
                for b in range(0, x.shape[2], 100)
            ],
            2,
        )
        assert torch.all(per_token <= bound * 1.01 + 1e-4)


def test_rotary_and_exact_options_follow_positions_across_bitstreams(
    tiny_kv, tiny_llama, isolated_profiles
):
    """Keys are turned by the angles of their absolute positions and only the first tokens of
    the sequence are stored exactly, however the tokens are split into bitstreams."""
    cfg = dataclasses.replace(
        ensure_profile(tiny_llama).config(2), hadamard=True, rope_theta=10000.0, exact_tokens=3
    )
    add_level(tiny_llama, 11, cfg)
    add_level(tiny_llama, 12, dataclasses.replace(cfg, exact_tokens=0))
    codec = codec_for("cachegen", tiny_llama, chunk_tokens=64)
    whole = decode(codec.encode(tiny_kv, 11))
    parts = KVCache.concat([decode(codec.encode(c, 11)) for c in tiny_kv.chunks(64)])
    assert torch.equal(whole.keys, parts.keys) and torch.equal(whole.values, parts.values)
    first, later = tiny_kv.slice(0, 64), tiny_kv.slice(64, 128)
    exact_bytes = (
        2 * first.num_layers * first.num_kv_heads * 3 * first.head_dim * first.dtype.itemsize
    )
    assert len(codec.encode(first, 11)) == len(codec.encode(first, 12)) + exact_bytes
    assert len(codec.encode(later, 11)) == len(codec.encode(later, 12))


def test_keys_turned_back_by_rotary_angles_are_the_models_pre_rope_keys(tiny_llama):
    """The codec's rotary convention is the model's: turning the cached keys back gives what
    k_proj computed (a wrong convention would still decode right but compress worse)."""
    from cachegen import models
    from cachegen.extract import extract_kv, load_model

    hf_model, _, spec = load_model(tiny_llama, torch.float32)
    thetas = models.rope_thetas(spec.config)
    assert min(thetas) > 0 and not any(models.rope_thetas(models.resolve("tiny-opt").config))
    ids = torch.arange(3, 203)
    captured = []
    layer = hf_model.model.layers[-1].self_attn
    hook = layer.k_proj.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        kv = extract_kv(tiny_llama, token_ids=ids, dtype=torch.float32)
        with torch.no_grad():
            hf_model(ids[None])
    finally:
        hook.remove()
    identity = spec.identity()
    pre_rope = (
        captured[-1][0].view(len(ids), identity.num_kv_heads, identity.head_dim).transpose(0, 1)
    )
    turned_back = rotary.rotate_keys(kv.keys[-1].float(), 0, thetas[-1], inverse=True)
    torch.testing.assert_close(
        turned_back, pre_rope, rtol=1e-4, atol=1e-4 * float(pre_rope.abs().max())
    )
    assert not torch.allclose(kv.keys[-1].float(), pre_rope, atol=1e-2)


def test_stacked_rotary_tables_hold_each_thetas_angles_read_only():
    # tcq's decoder indexes one table for all of a model's rotary bases (Gemma 3 has two):
    # position p under thetas[i] is row i * P + p, the same angles as rotary_cos_sin's
    thetas = (10000.0, 1000000.0)
    cos, sin, positions = rotary.rotary_tables(64, thetas, 5000)
    assert positions >= 5000 and cos.shape == sin.shape == (2 * positions, 64)
    for i, theta in enumerate(thetas):
        want_cos, want_sin = rotary.rotary_cos_sin(4990, 10, 64, theta)
        rows = slice(i * positions + 4990, i * positions + 5000)
        assert np.array_equal(cos[rows], want_cos.numpy())
        assert np.array_equal(sin[rows], want_sin.numpy())
    assert not cos.flags.writeable and not sin.flags.writeable  # shared: never written


def test_decoder_rotary_kernel_is_the_torch_rotation_bit_for_bit():
    """The decoder turns keys forward in a numba pass; it must give what ``rotary.apply_rotary``
    gives (quality is measured through the torch reference), in float32 and in bfloat16."""
    from cachegen.codec.cachegen.kernels import store_rotated

    torch.manual_seed(5)
    src = torch.randn(6, 40, 64) * 7
    cos, sin = rotary.rotary_cos_sin(1000, 40, 64, 100000.0)
    expected = rotary.apply_rotary(src, cos, sin)
    as_f32 = torch.empty(6, 50, 64)[:, 5:45]  # a strided view, as the decoder writes into
    store_rotated(
        src.numpy(), cos.numpy(), sin.numpy(), True, as_f32.numpy(), np.empty((0, 0, 0), np.uint16)
    )
    assert torch.equal(as_f32, expected)
    as_bf16 = torch.empty(6, 40, 64, dtype=torch.bfloat16)
    bits = as_bf16.view(torch.int16).numpy().view(np.uint16)
    store_rotated(
        src.numpy(), cos.numpy(), sin.numpy(), True, np.empty((0, 0, 0), np.float32), bits
    )
    assert torch.equal(as_bf16, expected.to(torch.bfloat16))
    store_rotated(
        src.numpy(), cos.numpy(), sin.numpy(), False, np.empty((0, 0, 0), np.float32), bits
    )
    assert torch.equal(as_bf16, src.to(torch.bfloat16))


def _segment_bound(x, cfg, kind):
    """Per-token error norm bound of one chunk: half a step for every element of its segment."""
    out = torch.empty(x.shape[:3])
    m = torch.tensor([quant.max_level(b) for b in cfg.bins(kind)], dtype=torch.float32).view(
        -1, 1, 1, 1
    )
    for seg in quant.quantize_chunk(x, cfg, kind):
        step = (seg.scales.float() / m / 2).expand(*seg.symbols.shape)
        out[:, :, seg.tokens] = step.pow(2).sum(-1).sqrt()
    return out


# ---- real KV ---------------------------------------------------------------------------------


def test_fresh_profile_of_the_embedded_model_has_its_calibrated_levels(smollm2, isolated_profiles):
    """A new install gets the levels `cachegen calibrate` chose (docs/quality.md), default
    included."""
    profile = ensure_profile(smollm2)
    assert sorted(profile.levels) == [1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert profile.default_level == 11  # chosen to be stored coded and packed (docs/quality.md)
    default = profile.config(11)
    assert default.hadamard and default.rope_theta == 100000.0 and default.exact_tokens == 1
    assert default.key_bins == (32,) * 30 and default.value_bins == (8,) * 30
    assert profile.config(4).key_bins[:3] == (24, 32, 32)  # the earlier default stays
    assert codec_for("cachegen", smollm2).default_level == 11


def test_a_profile_of_an_older_release_gets_the_new_shipped_levels(smollm2, isolated_profiles):
    """A profile built before level 11 shipped (default 4) gets level 11 and its default on
    first use; a level the user added stays, and so does a default the user chose."""
    profile = ensure_profile(smollm2)
    tables_id = profile.tables_ids[11]
    del profile.levels[11], profile.tables_ids[11]
    profile.default_level = 4
    profile.levels[12] = profile.config(8)
    profile.tables_ids[12] = profile.tables_ids[8]
    profile.save()
    upgraded = ensure_profile(smollm2)
    assert upgraded.default_level == 11 and upgraded.tables_ids[11] == tables_id
    assert upgraded.config(12) == profile.config(8)  # the user's level stays
    upgraded.set_default_level(12)
    assert ensure_profile(smollm2).default_level == 12  # nothing new shipped: the user's default


def test_gemma_levels_turn_keys_back_with_each_layers_own_base(gemma3, isolated_profiles):
    """Gemma 3's shipped levels carry its two rotary bases (sliding 10,000, full 1,000,000);
    its streams are format version 2, decode close to the KV, and are smaller than with one
    base for every layer (the wrong base still decodes right, it just codes worse)."""
    from cachegen import workload
    from cachegen.extract import extract_kv

    profile = ensure_profile(gemma3)
    assert sorted(profile.levels) == [1, 2, 3, 4, 5, 6, 8, 9] and profile.default_level == 9
    thetas = profile.config(4).layer_thetas
    assert thetas[5] == 1e6 and thetas[0] == 1e4 and thetas.count(1e6) == 3
    kv = extract_kv(gemma3, text=workload.text("eval")[:3000]).slice(0, 512)
    codec = codec_for("cachegen", gemma3)
    blob = codec.encode(kv, 4)
    assert parse_header(blob).version == 2
    out = decode(blob, out_dtype=torch.float32)
    err = (out.keys - kv.keys.float()).norm() / kv.keys.float().norm()
    assert err < 0.05
    one_base = dataclasses.replace(profile.config(4), rope_theta=1e4)
    add_level(gemma3, 11, one_base)
    assert len(codec_for("cachegen", gemma3).encode(kv, 11)) > len(blob)


@pytest.fixture(scope="session")
def smollm2_kv(smollm2) -> KVCache:
    from cachegen import workload
    from cachegen.extract import extract_kv

    return extract_kv(smollm2, text=workload.text("eval")[:4000]).slice(0, 256)


def test_cachegen_compresses_real_kv_like_the_paper(smollm2, smollm2_kv):
    codec = codec_for("cachegen", smollm2)
    sizes = {}
    for level in (1, 2, 3):
        info = inspect(codec.encode(smollm2_kv, level))
        sizes[level] = info["bits_per_element"]
        assert info["ratio_vs_int8"] > 2.0
    assert sizes[1] < sizes[2] < sizes[3] < 4.0
    int8_zstd = inspect(get_codec("int8-zstd").encode(smollm2_kv))["bits_per_element"]
    assert sizes[3] < int8_zstd


def test_odd_geometry_uses_the_partial_lane_paths():
    """12 channels per layer: one full group of 8 lanes and a partial one, in both coders."""
    from cachegen.codec.cachegen.codec import CacheGenCodec
    from cachegen.codec.cachegen.profile import Profile
    from cachegen.codec.coding import rans
    from cachegen.codec.coding.tables import LevelTables, alphabets, remember
    from cachegen.kv import ModelIdentity

    model = ModelIdentity("odd-test-model", "ab" * 32, num_layers=3, num_kv_heads=1, head_dim=12)
    cfg = QuantConfig((32, 16, 8), (16, 16, 4), key_scale="channel", value_scale="token-head")
    sizes = alphabets(cfg, model)
    gen = np.random.default_rng(0)
    counts = gen.integers(0, 1000, size=(sizes.size, 31))
    freq = rans.quantize_frequencies(counts, sizes)
    tables = LevelTables("0123456789abcdef" * 2, cfg, model, freq)
    remember(tables)
    profile = Profile(model, {1: cfg}, {1: tables.id}, 1, calibration={})
    x = torch.randn(2, 3, 1, 37, 12, generator=torch.Generator().manual_seed(1)) * 3
    kv = KVCache(x[0], x[1], torch.arange(37), model, start=5)
    blob = CacheGenCodec(profile=profile, chunk_tokens=16).encode(kv)
    out = decode(blob, out_dtype=torch.float32)
    for kind, a, b in (("k", kv.keys, out.keys), ("v", kv.values, out.values)):
        assert torch.all((a - b).abs() <= _step_bound_chunked(a, cfg, kind, 16) * 1.001 + 1e-6)


# Relative error bound per codec: raw is lossless, the 8-bit codecs lose about 2%, KIVI's
# 2 bits and cachegen's default level (paper level 2 on a model without shipped levels) more.
GEMMA3_ERROR = {"raw": 0.0, "int8": 0.05, "int8-zstd": 0.05, "fp8": 0.05, "kivi2": 0.6,
                "cachegen": 0.35, "kvtc": 0.4, "turboquant": 0.2, "tcq": 0.25,
                "lmcache-cachegen": 0.3, "lmcache-fp8": 0.05,
                "lmcache-asym-k16-v8": 0.05}  # fmt: skip


def test_gemma3_kv_round_trips(gemma3, small_fits):
    """One KV head of head_dim 256, sliding and full layers alike: every codec decodes it (the
    transform codecs with model files fitted on less text than the recipe's)."""
    from cachegen import workload
    from cachegen.extract import extract_kv, load_model, tokenize

    ids = tokenize(load_model(gemma3)[1], workload.text("eval")[:3000])[:300]
    with torch_on_own_cores():  # the model runs, here and in the transform codecs' fits
        kv = extract_kv(gemma3, token_ids=ids)
        for name in available_codecs():
            codec = codec_for(name, gemma3, chunk_tokens=128)
            out = decode(codec.encode(kv), out_dtype=torch.float32)
            assert out.keys.shape == kv.keys.shape and out.model == kv.model
            for got, want in ((out.keys, kv.keys), (out.values, kv.values)):
                error = (got - want.float()).norm() / want.float().norm()
                assert error <= GEMMA3_ERROR[name], (name, float(error))
