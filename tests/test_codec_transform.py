"""Transform codecs (KVTC and TurboQuant) and their shared machinery: quantizers, bit
allocation, the basis file, round trips, size accounting and bad input."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch

from cachegen import workload
from cachegen.codec import CodecError, available_codecs, decode, get_codec, inspect, transform
from cachegen.codec import kvtc as kvtc_mod
from cachegen.codec.bitstream import pack_frame, parse_frames, parse_header
from cachegen.kv import KVCache
from cachegen.profiles import codec_for, ensure_kvtc_basis, kvtc_calibration_spec

TEXT = "\n\n".join(
    ["The quick brown fox jumps over the lazy dog. " * 12, "def f(x):\n    return x * 2\n" * 12]
)
LEVELS = {"kvtc": sorted(kvtc_mod.LEVELS), "turboquant": [25, 35]}


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """A profile directory of this module's own (the basis is fitted once into it)."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("profiles")
    mp.setenv("CACHEGEN_PROFILE_DIR", str(path))
    transform.forget_cached_bases()
    yield path
    transform.forget_cached_bases()
    mp.undo()


@pytest.fixture(scope="module")
def kv(tiny_llama) -> KVCache:
    from cachegen.extract import extract_kv

    return extract_kv(tiny_llama, text=TEXT)


@pytest.fixture(scope="module")
def basis(tiny_llama, profiles):
    return ensure_kvtc_basis(tiny_llama)


def f32(kv: KVCache) -> torch.Tensor:
    return torch.stack([kv.keys, kv.values]).to(torch.float32)


def relative_error(out: KVCache, kv: KVCache) -> float:
    return float((f32(out) - f32(kv)).norm() / f32(kv).norm())


def test_both_codecs_are_available():
    assert {"kvtc", "turboquant"} <= set(available_codecs())


def test_lloyd_max_codebooks_match_the_published_gaussian_quantizers():
    # Max (1960): positive reconstruction levels and MSE of the unit Gaussian
    published = {
        1: ([0.7979], 0.3634),
        2: ([0.4528, 1.510], 0.1175),
        3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
    }
    for bits, (levels, mse) in published.items():
        got, thresholds, got_mse = transform.lloyd_max(bits)
        assert np.allclose(got[len(got) // 2 :], levels, atol=1e-3)
        assert np.allclose(got, -got[::-1]) and len(thresholds) == len(got) - 1
        assert got_mse == pytest.approx(mse, rel=1e-3)
    assert np.all(np.diff(transform.gaussian_mse()) < 0)


def test_bit_allocation_follows_the_variances_within_the_budget():
    variances = np.array([16.0, 4.0, 1.0, 0.25, 0.0])
    bits = transform.allocate_bits(variances, 9)
    assert bits.sum() == 9 and list(bits) == sorted(bits, reverse=True)
    assert bits[0] > bits[2] and bits[-1] == 0  # no variance: dropped whatever the budget
    assert transform.allocate_bits(variances, 100).tolist() == [8, 8, 8, 8, 0]
    assert transform.allocate_bits(variances, 0).sum() == 0


def test_pca_basis_is_orthonormal_and_sorted():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6)) + 3.0
    mean, components, variances = transform.fit_pca(x)
    assert np.allclose(components @ components.T, np.eye(6), atol=1e-9)
    assert np.all(np.diff(variances) <= 0) and np.allclose(mean, x.mean(axis=0))
    assert np.allclose(((x - mean) @ components.T).var(axis=0), variances)


def test_pack_bits_round_trips_every_width():
    for bits in range(1, 9):
        codes = torch.randint(0, 1 << bits, (37,), dtype=torch.uint8)
        data = transform.pack_bits(codes, bits)
        assert len(data) == transform.packed_size(37, bits)
        assert torch.equal(transform.unpack_bits(data, bits, 37), codes)


@pytest.mark.parametrize("name", ["kvtc", "turboquant"])
def test_round_trip_shapes_dtypes_and_error_falls_with_the_level(name, kv, tiny_llama, basis):
    part = kv.slice(2, 170)  # starts inside kvtc's exact tokens, spans 3 frames
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    assert codec.levels == LEVELS[name]
    errors = []
    for level in codec.levels:
        blob = codec.encode(part, level)
        assert codec.encode(part, level) == blob
        out = decode(blob, out_dtype=torch.float32)
        assert out.keys.shape == part.keys.shape and out.keys.dtype == torch.float32
        assert out.start == 2 and torch.equal(out.token_ids, part.token_ids)
        assert out.model == part.model
        assert decode(blob, out_dtype=torch.float16).values.dtype == torch.float16
        assert decode(blob).keys.dtype == torch.bfloat16
        errors.append(relative_error(out, part))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.5, errors


def test_kvtc_keeps_the_first_four_tokens_exact(kv, tiny_llama, basis):
    codec = codec_for("kvtc", tiny_llama, chunk_tokens=3)  # the exact tokens span two frames
    out = decode(codec.encode(kv.slice(0, 10), level=10))
    assert torch.equal(out.keys[:, :, :4], kv.keys[:, :, :4])
    assert torch.equal(out.values[:, :, :4], kv.values[:, :, :4])
    assert not torch.equal(out.keys[:, :, 4:], kv.keys[:, :, 4:10])


def test_turboquant_error_matches_its_quantizers(kv, tiny_llama):
    """After the random rotation the coordinates are near N(0, 1): the relative squared error
    is close to the mean of the two Lloyd-Max quantizers' MSE."""
    codec = get_codec("turboquant")
    mse = transform.gaussian_mse()
    for level, (high, low) in {25: (3, 2), 35: (4, 3)}.items():
        out = decode(codec.encode(kv, level), out_dtype=torch.float32)
        expected = (mse[high] + mse[low]) / 2
        assert relative_error(out, kv) ** 2 == pytest.approx(expected, rel=0.25)


@pytest.mark.parametrize("name", ["kvtc", "turboquant"])
def test_bits_per_element_counts_every_byte(name, kv, tiny_llama, basis):
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    blob = codec.encode(kv, codec.levels[0])
    info = inspect(blob)
    assert info["bytes"] == len(blob)
    assert info["bits_per_element"] * kv.num_elements == pytest.approx(8 * len(blob))
    layers = sum(r["key_bytes"] + r["value_bytes"] for r in info["layers"])
    overhead = info["header_bytes"] + info["frame_header_bytes"] + info["token_id_bytes"]
    assert layers + overhead == pytest.approx(len(blob))
    if name == "turboquant":  # norms (fp16 per token and head) and the codes, exactly
        vectors = 2 * kv.num_layers * kv.num_kv_heads * kv.num_tokens
        assert layers == 2 * vectors + vectors * kv.head_dim * 2.5 / 8
    else:  # the basis is shared per model, like cachegen's tables, and reported separately
        assert info["transform"] == basis.id and info["transform_bytes"] == basis.nbytes


def test_basis_is_fitted_on_the_calibration_split_only(tiny_llama, profiles, monkeypatch):
    from cachegen import profiles as profiles_mod

    read = []
    original = workload.text

    def recording_text(split):
        read.append(split)
        return original(split)

    monkeypatch.setattr(workload, "text", recording_text)
    basis = profiles_mod.fit_kvtc_basis(tiny_llama)
    assert set(read) == {"calibrate"}
    assert basis.calibration == kvtc_calibration_spec()
    assert basis.calibration["split"] == "calibrate"


def test_basis_file_round_trips_and_is_content_addressed(basis, profiles):
    path = transform.basis_path(basis.id)
    assert path.is_file() and path.stat().st_size == basis.nbytes
    again = transform.parse_basis(path.read_bytes(), str(path), basis.id)
    assert again.id == basis.id and again.levels == basis.levels
    assert np.array_equal(again.components, basis.components)
    ref = json.loads(kvtc_mod.basis_ref_path(basis.model).read_text())
    assert (ref["schema"], ref["version"], ref["basis"]) == (
        kvtc_mod.REF_SCHEMA,
        kvtc_mod.REF_VERSION,
        basis.id,
    )


def test_corrupt_basis_is_detected_by_its_checksum(kv, tiny_llama, basis, profiles):
    blob = codec_for("kvtc", tiny_llama).encode(kv, level=20)
    path = transform.basis_path(basis.id)
    good = path.read_bytes()
    bad = bytearray(good)
    bad[-100] ^= 0x01
    try:
        path.write_bytes(bytes(bad))
        transform.forget_cached_bases()
        with pytest.raises(CodecError, match="corrupt"):
            decode(blob)
        # without the id to compare, the header's checksum of the arrays still catches it
        with pytest.raises(CodecError, match="checksum of the arrays"):
            transform.parse_basis(bytes(bad), "test")
        with pytest.raises(CodecError, match="unreadable"):
            transform.parse_basis(good[:-8], "test")
        path.unlink()
        transform.forget_cached_bases()
        with pytest.raises(CodecError, match="copy"):
            decode(blob)
    finally:
        path.write_bytes(good)
        transform.forget_cached_bases()
    assert decode(blob).num_tokens == kv.num_tokens


def test_basis_of_another_model_or_level_is_refused(kv, tiny_llama, tiny_qwen2, basis):
    from cachegen.extract import extract_kv

    codec = codec_for("kvtc", tiny_llama)
    other = extract_kv(tiny_qwen2, text="Another model entirely. " * 8)
    with pytest.raises(CodecError, match="fitted for model"):
        codec.encode(other)
    with pytest.raises(CodecError, match="fitted for model"):
        transform.find_basis(basis.id, other.model)
    with pytest.raises(CodecError, match="no level 7"):
        codec.encode(kv, level=7)
    with pytest.raises(CodecError, match="no level 7"):
        basis.level_bits(7)


def _reframe(blob: bytes, body) -> bytes:
    """``blob`` with its first frame's body replaced (checksums recomputed)."""
    header = parse_header(blob)
    frames = parse_frames(blob, header)
    first = pack_frame(torch.from_numpy(frames[0].token_ids), header.token_width, body)
    return bytes(blob[: header.size]) + first + bytes(blob[header.size + frames[0].size :])


@pytest.mark.parametrize("name", ["kvtc", "turboquant"])
def test_truncated_and_flipped_frames_are_refused(name, kv, tiny_llama, basis):
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    blob = codec.encode(kv.slice(0, 100))
    for cut in range(1, len(blob), max(1, len(blob) // 40)):
        with pytest.raises(CodecError):
            decode(blob[:cut])
    rng = np.random.default_rng(0)
    for position in rng.integers(0, len(blob), 40):
        bad = bytearray(blob)
        bad[position] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodecError):
            decode(bytes(bad))
    # bodies with valid frame checksums but a layout the header does not allow
    body = parse_frames(blob, parse_header(blob))[0].body
    for bad_body in (bytes(body)[:-1], bytes(body) + b"\0"):
        with pytest.raises(CodecError, match="corrupt"):
            decode(_reframe(blob, bad_body))


def test_kvtc_stream_that_inflates_wrongly_is_refused(kv, tiny_llama, basis):
    codec = codec_for("kvtc", tiny_llama, chunk_tokens=64)
    blob = codec.encode(kv.slice(0, 64), level=20)
    header = parse_header(blob)
    body = bytes(parse_frames(blob, header)[0].body)
    exact = 2 * 4 * 2 * 4 * 64 * 2  # layers, K/V, heads, exact tokens, head_dim, bf16
    count = 2 * header.num_layers
    sizes = list(struct.unpack_from(f"<{count}I", body, exact))
    streams = body[exact + 4 * count :]
    bomb = zlib.compress(b"\0" * 1_000_000)
    first, rest = streams[: sizes[0]], streams[sizes[0] :]
    assert len(first) == sizes[0]
    for replacement in (bomb, zlib.compress(b"\x07" * 10), b"not zlib"):
        new_sizes = [len(replacement)] + sizes[1:]
        new_body = body[:exact] + struct.pack(f"<{count}I", *new_sizes) + replacement + rest
        with pytest.raises(CodecError, match="corrupt"):
            decode(_reframe(blob, new_body))


def test_codec_needs_a_basis_and_never_fits_one(kv, tiny_opt, profiles):
    codec = get_codec("kvtc")
    with pytest.raises(CodecError, match="needs a model"):
        codec.levels  # noqa: B018
    from cachegen.extract import extract_kv

    other = extract_kv(tiny_opt, text="No basis was fitted for this model. " * 4)
    with pytest.raises(CodecError, match="no kvtc basis"):
        codec.encode(other)


def test_turboquant_refuses_a_head_dim_that_is_not_a_power_of_two(kv):
    from cachegen.kv import ModelIdentity

    odd = KVCache(
        keys=torch.zeros(1, 1, 3, 48, dtype=torch.bfloat16),
        values=torch.zeros(1, 1, 3, 48, dtype=torch.bfloat16),
        token_ids=torch.arange(3),
        model=ModelIdentity("odd", "0" * 64, 1, 1, 48),
    )
    with pytest.raises(CodecError, match="power-of-two"):
        get_codec("turboquant").encode(odd)


def test_cli_eval_rows_for_cachegen_kvtc_and_turboquant(capsys, tmp_path, tiny_llama, basis):
    from cachegen.cli import main

    text = tmp_path / "notes.txt"
    text.write_text("A plain text file about nothing in particular, told twice over. " * 60)
    code = main(
        ["eval", "--model", "tiny-llama", "--dataset", str(text), "--windows", "1"]
        + ["--context-tokens", "96", "--continuation-tokens", "16", "--gen-tokens", "4"]
        + ["--codec", "cachegen:2", "--codec", "kvtc", "--codec", "turboquant"]
        + ["--no-progress", "--json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    rows = [(r["codec"], r["level"]) for r in json.loads(out)]
    assert rows == [("cachegen", "2")] + [
        (name, str(level)) for name in ("kvtc", "turboquant") for level in LEVELS[name]
    ]


def test_cli_encode_inspect_decode_kvtc(capsys, tmp_path, kv, basis):
    from cachegen.cli import main

    kv.save(tmp_path / "kv")
    blob = tmp_path / "kv.cgkv"
    assert (
        main(["encode", "--codec", "kvtc", "--level", "30", str(tmp_path / "kv"), str(blob)]) == 0
    )
    assert main(["inspect", "--json", str(blob)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(blob)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["codec"], info["level"], info["transform"]) == ("kvtc", 30, basis.id)
    assert main(["decode", str(blob), str(tmp_path / "out")]) == 0
    assert KVCache.load(tmp_path / "out").keys.shape == kv.keys.shape


def test_rd_sweep_grid_holds_every_transform_level(tiny_llama, basis):
    from cachegen.lab.quality.rd_sweep import grid

    names = {f"{c.codec}/{c.level}" for c in grid(tiny_llama, include_variants=False)}
    assert {f"{name}/{level}" for name in LEVELS for level in LEVELS[name]} <= names
