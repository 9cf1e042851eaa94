"""The research transform codecs (KVTC and TurboQuant): round trips, the kvtc basis they code
with, size accounting, bad input and their documented layouts (docs/bitstream.md)."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError, available_codecs, decode, get_codec, inspect
from cachegen.codec.coding.bitstream import pack_frame, parse_frames, parse_header
from cachegen.codec.transform import basis as transform
from cachegen.codec.transform import kvtc_basis, lloyd_max
from cachegen.fitting.kvtc import ensure_kvtc_basis, fit_kvtc_basis, kvtc_calibration_spec
from cachegen.kv import KVCache
from cachegen.profiles import codec_for
from cachegen_lab.codecs.kvtc import KvtcCodec
from tests.codec import transform_support as shared
from tests.codec.transform_support import relative_error

LEVELS = {"kvtc": sorted(kvtc_basis.LEVELS), "turboquant": [25, 35]}


@pytest.fixture(scope="module")
def basis(tiny_llama, profiles):
    return ensure_kvtc_basis(tiny_llama)


def test_both_codecs_are_available():
    assert {"kvtc", "turboquant"} <= set(available_codecs())


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
    mse = lloyd_max.gaussian_mse()
    for level, (high, low) in {25: (3, 2), 35: (4, 3)}.items():
        out = decode(codec.encode(kv, level), out_dtype=torch.float32)
        expected = (mse[high] + mse[low]) / 2
        assert relative_error(out, kv) ** 2 == pytest.approx(expected, rel=0.25)


@pytest.mark.parametrize("name", ["kvtc", "turboquant"])
def test_bits_per_element_counts_every_byte(name, kv, tiny_llama, basis):
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    blob = codec.encode(kv, codec.levels[0])
    info, layers = shared.check_every_byte_is_counted(blob, kv)
    if name == "turboquant":  # norms (fp16 per token and head) and the codes, exactly
        vectors = 2 * kv.num_layers * kv.num_kv_heads * kv.num_tokens
        assert layers == 2 * vectors + vectors * kv.head_dim * 2.5 / 8
    else:  # the basis is shared per model, like cachegen's tables, and reported separately
        assert info["transform"] == basis.id and info["transform_bytes"] == basis.nbytes


def test_basis_is_fitted_on_the_calibration_split_only(tiny_llama, profiles, monkeypatch):
    basis, read = shared.fit_recording_splits(monkeypatch, lambda: fit_kvtc_basis(tiny_llama))
    assert set(read) == {"calibrate"}
    assert basis.calibration == kvtc_calibration_spec()
    assert basis.calibration["split"] == "calibrate"


def test_basis_file_round_trips_and_is_content_addressed(basis, profiles):
    again = shared.read_back(basis, transform.basis_path(basis.id), transform.parse_basis)
    assert np.array_equal(again.components, basis.components)
    shared.check_reference(kvtc_basis.basis_ref_path(basis.model), kvtc_basis, "basis", basis.id)


def test_corrupt_basis_is_detected_by_its_checksum(kv, tiny_llama, basis, profiles):
    blob = codec_for("kvtc", tiny_llama).encode(kv, level=20)
    path = transform.basis_path(basis.id)
    shared.check_corrupt_file_is_detected(blob, kv.num_tokens, path, transform.parse_basis)


def test_basis_of_another_model_or_level_is_refused(kv, tiny_llama, tiny_qwen2, basis):
    codec = codec_for("kvtc", tiny_llama)
    shared.check_another_model_is_refused(
        codec, kv, tiny_qwen2, lambda other: transform.find_basis(basis.id, other)
    )
    with pytest.raises(CodecError, match="no level 7"):
        basis.level_bits(7)


@pytest.mark.parametrize("name", ["kvtc", "turboquant"])
def test_truncated_and_flipped_frames_are_refused(name, kv, tiny_llama, basis):
    codec = codec_for(name, tiny_llama, chunk_tokens=64)
    blob = codec.encode(kv.slice(0, 100))
    shared.check_truncated_and_flipped_are_refused(blob)
    # bodies with valid frame checksums but a layout the header does not allow
    body = parse_frames(blob, parse_header(blob))[0].body
    for bad_body in (bytes(body)[:-1], bytes(body) + b"\0"):
        with pytest.raises(CodecError, match="corrupt"):
            decode(shared.reframe(blob, bad_body))


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
            decode(shared.reframe(blob, new_body))


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
    rows = shared.cli_eval_rows(capsys, tmp_path, ["cachegen:2", "kvtc", "turboquant"])
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
    from cachegen_lab.quality.rd_sweep import grid

    names = {f"{c.codec}/{c.level}" for c in grid(tiny_llama, include_variants=False)}
    assert {f"{name}/{level}" for name in LEVELS for level in LEVELS[name]} <= names


# ---- the documented layouts (docs/bitstream.md), read by hand so the doc cannot drift ----


class _Reader:
    """Reads little-endian fields from ``data`` at a moving offset."""

    def __init__(self, data: bytes, pos: int = 0) -> None:
        self.data, self.pos = data, pos

    def take(self, size: int) -> bytes:
        out = self.data[self.pos : self.pos + size]
        assert len(out) == size, "the documented layout runs past the end"
        self.pos += size
        return out

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))


def _documented_header(blob: bytes) -> tuple[dict, _Reader]:
    """The header fields at the offsets the header table gives, and a reader at frame 0."""
    r = _Reader(blob)
    fields = dict(
        zip(
            ["magic", "version", "codec_id", "level", "dtype", "flags", "layers", "heads"]
            + ["head_dim", "start", "tokens", "chunk"],
            r.unpack("4sBBHBBHHHQII"),
        )
    )
    assert r.pos == 32 and fields["magic"] == b"CGKV"
    fields["name"] = r.take(r.unpack("B")[0]).decode()
    fingerprint = r.take(r.unpack("B")[0])
    fields["fingerprint"] = fingerprint.hex() if fields["flags"] & 2 else fingerprint.decode()
    fields["params"] = r.take(r.unpack("H")[0])
    (crc,) = r.unpack("I")
    assert zlib.crc32(blob[: r.pos - 4]) == crc
    return fields, r


def _documented_frames(blob: bytes, fields: dict, r: _Reader):
    """(first token position, token ids, body) of each frame, by the frame table."""
    width = 4 if fields["flags"] & 1 else 2
    for index in range(-(-fields["tokens"] // fields["chunk"])):
        length, crc = r.unpack("II")
        payload = r.take(length)
        assert zlib.crc32(payload) == crc
        n = min(fields["chunk"], fields["tokens"] - index * fields["chunk"])
        ids = np.frombuffer(payload[: n * width], dtype="<u4" if width == 4 else "<u2")
        yield fields["start"] + index * fields["chunk"], ids, payload[n * width :]
    assert r.pos == len(blob), "nothing may follow the last frame"


def _lsb_codes(data: bytes, width: int, count: int) -> np.ndarray:
    """``count`` codes of ``width`` bits from a little-endian bit string."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    assert len(data) == -(-count * width // 8) and not bits[count * width :].any()
    planes = bits[: count * width].reshape(count, width).astype(np.int64)
    return (planes << np.arange(width)).sum(axis=1)


def _lloyd_max_levels(width: int) -> np.ndarray:
    return lloyd_max.lloyd_max(width)[0].astype(np.float32)


def _documented_basis(path, basis_id: str) -> dict:
    """The basis file by the CGTR table: JSON header and the four arrays."""

    data = path.read_bytes()
    assert hashlib.sha256(data).hexdigest()[:32] == basis_id
    r = _Reader(data)
    assert r.take(4) == b"CGTR"
    (json_len,) = r.unpack("I")
    raw = r.take(json_len)
    head = json.loads(raw)
    assert raw == json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    assert (head["schema"], head["version"]) == ("cachegen-transform-basis", 1)
    assert hashlib.sha256(data[r.pos :]).hexdigest() == head["payload_sha256"]
    model = head["model"]
    L, C, N = model["num_layers"], model["num_kv_heads"] * model["head_dim"], len(head["levels"])
    shapes = {"mean": [L, 2, C], "components": [L, 2, C, C], "variances": [L, 2, C]}
    shapes["bits"] = [N, L, 2, C]
    assert head["arrays"] == shapes and len(head["rope_thetas"]) == L
    arrays = {}
    for name, dtype in (
        ("mean", "<f4"),
        ("components", "<f4"),
        ("variances", "<f4"),
        ("bits", "u1"),
    ):
        count = int(np.prod(shapes[name]))
        raw_array = r.take(count * np.dtype(dtype).itemsize)
        arrays[name] = np.frombuffer(raw_array, dtype=dtype).reshape(shapes[name])
    assert r.pos == len(data), "nothing may follow the arrays"
    return {"head": head, "levels": [int(k) for k in head["levels"]], **arrays}


def test_kvtc_bitstream_and_basis_follow_the_documented_layout(kv, tiny_llama, basis, profiles):
    part = kv.slice(2, 130)  # frame 0 starts at position 2: 2 exact tokens; frame 1 none
    blob = codec_for("kvtc", tiny_llama, chunk_tokens=64).encode(part, level=20)
    fields, r = _documented_header(blob)
    dtype_code = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[part.dtype]
    assert (fields["version"], fields["codec_id"], fields["level"]) == (1, 10, 20)
    assert fields["dtype"] == dtype_code and fields["flags"] == 2  # u16 ids, digest fingerprint
    assert len(fields["params"]) == 16 and fields["params"].hex() == basis.id
    assert r.pos == 32 + 1 + len("tiny-llama") + 1 + 32 + 2 + 16 + 4
    doc = _documented_basis(profiles / "transforms" / f"{fields['params'].hex()}.cgtr", basis.id)
    bits = doc["bits"][doc["levels"].index(20)]
    L, H, D = fields["layers"], fields["heads"], fields["head_dim"]
    assert (L, H, D) == (part.num_layers, part.num_kv_heads, part.head_dim)
    thetas = doc["head"]["rope_thetas"]
    decoded, got, original = shared.decoded_and_original(blob, part)
    offset = 0
    for p, ids, body in _documented_frames(blob, fields, r):
        n = len(ids)
        e = min(max(4 - p, 0), n)
        m = n - e
        exact = shared.check_exact_tokens(body, original, offset, e)
        sizes = struct.unpack_from(f"<{2 * L}I", body, exact)
        pos = exact + 8 * L
        assert pos + sum(sizes) == len(body)
        for i in range(L):
            for k in range(2):
                raw = zlib.decompress(body[pos : pos + sizes[2 * i + k]])
                pos += sizes[2 * i + k]
                kept = np.flatnonzero(bits[i, k])
                y = np.zeros((m, len(kept)), dtype=np.float32)
                at = 0
                for w in range(8, 0, -1):
                    cols = np.flatnonzero(bits[i, k][kept] == w)
                    size = -(-len(cols) * m * w // 8)
                    codes = _lsb_codes(raw[at : at + size], w, len(cols) * m)
                    y[:, cols] = _lloyd_max_levels(w)[codes.reshape(len(cols), m).T]
                    at += size
                assert at == len(raw)
                sigma = np.sqrt(doc["variances"][i, k][kept])
                rows = (y * sigma) @ doc["components"][i, k][kept] + doc["mean"][i, k]
                coded = got[k, i, :, offset + e : offset + n]
                shared.check_synthesized(
                    rows, coded, thetas[i] if k == 0 else 0, np.arange(p + e, p + n)
                )
        offset += n
    assert offset == part.num_tokens and torch.equal(
        decoded.keys[:, :, :2], part.keys[:, :, :2].float()
    )


@pytest.mark.parametrize("level,hi,lo", [(25, 3, 2), (35, 4, 3)])
def test_turboquant_bitstream_follows_the_documented_layout(kv, level, hi, lo):

    blob = get_codec("turboquant", chunk_tokens=48).encode(kv.slice(0, 100), level=level)
    fields, r = _documented_header(blob)
    assert (fields["codec_id"], fields["level"], fields["params"]) == (11, level, b"")
    assert r.pos == 32 + 1 + len("tiny-llama") + 1 + 32 + 2 + 4
    L, H, D = fields["layers"], fields["heads"], fields["head_dim"]
    half = D // 2
    had = np.array(
        [[(-1) ** bin(a & b).count("1") for b in range(D)] for a in range(D)], dtype=np.float32
    ) / np.float32(np.sqrt(D))
    signs = np.empty((2, L, D), dtype=np.float32)
    for layer in range(L):
        for k in range(2):
            text = f"turboquant/{fields['fingerprint']}/{layer}/{k}".encode()
            seed = int.from_bytes(hashlib.sha256(text).digest()[:8], "little")
            rng = np.random.default_rng(seed)
            signs[k, layer] = rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=D)
    decoded = decode(blob, out_dtype=torch.float32)
    got = torch.stack([decoded.keys, decoded.values]).numpy()
    offset = 0
    for _, ids, body in _documented_frames(blob, fields, r):
        n = len(ids)
        vectors = 2 * L * H * n
        high_size, low_size = -(-vectors * half * hi // 8), -(-vectors * half * lo // 8)
        assert len(body) == 2 * vectors + high_size + low_size
        norms = np.frombuffer(body[: 2 * vectors], dtype="<f2").astype(np.float32)
        high = _lsb_codes(body[2 * vectors : 2 * vectors + high_size], hi, vectors * half)
        low = _lsb_codes(body[2 * vectors + high_size :], lo, vectors * half)
        y = np.concatenate(
            [
                _lloyd_max_levels(hi)[high].reshape(vectors, half),
                _lloyd_max_levels(lo)[low].reshape(vectors, half),
            ],
            axis=1,
        ).reshape(2, L, H, n, D)
        x = (y @ had) * signs[:, :, None, None, :] * (norms.reshape(2, L, H, n, 1) / np.sqrt(D))
        coded = got[:, :, :, offset : offset + n]
        assert np.allclose(x, coded, rtol=1e-4, atol=1e-4 * np.abs(coded).max())
        offset += n
    assert offset == 100


def _kvtc_header_for(other: KVCache, level: int, basis_id: str) -> bytes:
    """A well-formed kvtc bitstream of ``other`` (empty bodies) naming ``basis_id`` at
    ``level``: the decoder must refuse it before it looks at a body."""
    from cachegen.codec.coding.bitstream import pack_header

    header, width = pack_header(KvtcCodec.codec_id, level, other, 64, bytes.fromhex(basis_id))
    frames = [pack_frame(chunk.token_ids, width, b"") for chunk in other.chunks(64)]
    return header + b"".join(frames)


def test_kvtc_bitstream_naming_another_models_basis_is_refused(tiny_qwen2, basis):
    from cachegen.extract import extract_kv

    other = extract_kv(tiny_qwen2, text="A stream of another model. " * 8)
    blob = _kvtc_header_for(other, 20, basis.id)
    with pytest.raises(CodecError, match="fitted for model tiny-llama") as refused:
        decode(blob)
    assert "fit one for tiny-qwen2" in str(refused.value)
    with pytest.raises(CodecError, match="fitted for model tiny-llama"):
        inspect(blob)


def test_kvtc_bitstream_of_a_level_the_basis_lacks_is_refused(kv, tiny_llama, basis):
    blob = bytearray(codec_for("kvtc", tiny_llama, chunk_tokens=64).encode(kv.slice(0, 70)))
    header = parse_header(bytes(blob))
    struct.pack_into("<H", blob, 6, 25)  # a turboquant level; the header checksum made good
    struct.pack_into("<I", blob, header.size - 4, zlib.crc32(blob[: header.size - 4]))
    with pytest.raises(CodecError, match=r"has no level 25; levels are \[10, 15, 20, 30, 40\]"):
        decode(bytes(blob))
    with pytest.raises(CodecError, match="has no level 7"):
        decode(_kvtc_header_for(kv.slice(0, 70), 7, basis.id))


def test_basis_file_with_any_flipped_byte_is_refused_by_its_checksum(kv, tiny_llama, basis):
    """A flip in the magic, the JSON length, the JSON header (which the arrays' checksum does
    not cover) or any array is caught by the file's hash against the id the stream names."""
    blob = codec_for("kvtc", tiny_llama).encode(kv.slice(0, 40), level=20)
    path = transform.basis_path(basis.id)
    good = path.read_bytes()
    (json_len,) = struct.unpack_from("<I", good, 4)
    L, C = basis.model.num_layers, basis.model.num_kv_heads * basis.model.head_dim
    arrays = 8 + json_len
    positions = [0, 5, 8 + json_len // 2, 8 + json_len - 1]
    positions += [arrays, arrays + 4 * 2 * L * C + 7, arrays + 4 * (2 * L * C + 2 * L * C * C)]
    positions += [len(good) - len(basis.levels) * 2 * L * C, len(good) - 1]
    try:
        for position in positions:
            bad = bytearray(good)
            bad[position] ^= 0x10
            path.write_bytes(bytes(bad))
            transform.forget_cached_bases()
            with pytest.raises(CodecError, match="checksum does not match its id") as refused:
                decode(blob)
            assert "delete the file and copy or refit it" in str(refused.value)
    finally:
        path.write_bytes(good)
        transform.forget_cached_bases()
    assert decode(blob).num_tokens == 40
