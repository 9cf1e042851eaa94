"""The packed form of a ``tcq`` level: the coded form's symbols bit-packed per component. It
decodes to the same KV as the coded form, follows its documented layout, and refuses bad
input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError, decode, get_codec, inspect
from cachegen.codec.coding.bitstream import pack_header, parse_frames, parse_header
from cachegen.codec.tcq import model as tcq_model
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen.profiles import codec_for
from tests.codec import transform_support as shared

LEVELS = sorted(tcq_model.LEVELS)


@pytest.fixture(scope="module")
def model_file(tiny_llama, profiles) -> tcq_model.TcqModel:
    return ensure_tcq_model(tiny_llama)


def _same(a, b) -> bool:
    return torch.equal(a.keys.view(torch.int16), b.keys.view(torch.int16)) and torch.equal(
        a.values.view(torch.int16), b.values.view(torch.int16)
    )


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_packed_decodes_to_the_coded_forms_kv_at_every_level(kv, tiny_llama, model_file, out_dtype):
    # the packed form refines no row: it decodes as the coded form without refined rows
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64, refine=False)
    for level in LEVELS:
        coded = codec.encode(kv, level=level)
        packed = codec.encode(kv, level=level, form="packed")
        assert _same(decode(coded, out_dtype), decode(packed, out_dtype)), level
        info = inspect(packed)
        assert (info["codec"], info["form"], info["level"]) == ("tcq", "packed", level)
        assert info["bits_per_element"] > inspect(coded)["bits_per_element"]
        # the same model file; the packed form's frames carry choices, never predictions
        assert parse_header(packed).params == parse_header(coded).params[:16] + b"\x01"


def test_a_packed_layer_subset_decodes_to_the_same_values(kv, tiny_llama, model_file):
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64, refine=False)
    full = decode(codec.encode(kv, level=24))
    part = decode(codec.encode(kv.select_layers([1]), level=24, form="packed"))
    assert part.layers == (1,)
    assert torch.equal(part.keys[0], full.keys[1]) and torch.equal(part.values[0], full.values[1])


def test_codecs_without_a_packed_form_refuse_it(kv, tiny_llama, model_file):
    with pytest.raises(CodecError, match="no form 'packed'"):
        get_codec("int8").encode(kv, form="packed")
    with pytest.raises(CodecError, match="no form 'sparse'"):
        codec_for("tcq", tiny_llama).encode(kv, form="sparse")
    int8 = get_codec("int8")
    blob = int8.encode(kv)
    packed_header, _ = pack_header(int8.codec_id, 0, kv, int8.chunk_tokens, b"", form="packed")
    with pytest.raises(CodecError, match="packed symbols in a int8 stream"):
        decode(packed_header + blob[parse_header(blob).size :])


def _documented_body(body: bytes, doc: dict, x: int, L: int, e_bytes: int, m: int):
    """Every stream's symbols [kept, m] and offsets read from a packed body by the documented
    layout (docs/bitstream.md, "tcq bodies", the packed form)."""
    kept = [np.flatnonzero(doc["radius"][x, i, k]) for i in range(L) for k in range(2)]
    total = sum(len(c) for c in kept)
    at = e_bytes
    offsets = np.frombuffer(body, np.int8, total, at)
    lows = np.frombuffer(body, np.uint8, total, at + total)
    widths = np.frombuffer(body, np.uint8, total, at + 2 * total)
    at += 3 * total
    symbols, j = [], 0
    for comps in kept:
        rows = []
        for _ in comps:
            w, low = int(widths[j]), int(lows[j])
            size = -(-m // 8) * w
            bits = np.unpackbits(np.frombuffer(body, np.uint8, size, at), bitorder="little")
            fields = bits[: m * w].reshape(m, w) @ (1 << np.arange(w)) if w else np.zeros(m)
            rows.append(fields + low)
            at += size
            j += 1
        symbols.append(np.array(rows, dtype=np.int64).reshape(len(comps), m))
    assert at == len(body)
    return kept, symbols, offsets


def test_tcq_packed_body_follows_the_documented_layout(kv, tiny_llama, model_file):
    from tests.codec.test_tcq import _documented_model_file

    part = kv.slice(0, 100)  # frame 0 starts at position 0: 1 exact token; frame 1 none
    level = LEVELS[0]
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64)
    blob = codec.encode(part, level=level, form="packed")
    header = parse_header(blob)
    assert header.form == "packed" and header.version == 5 and blob[9] == 2 | 8
    doc = _documented_model_file(tcq_model.tcq_model_path(model_file.id), model_file.id)
    x = doc["levels"].index(level)
    decoded, got, original = shared.decoded_and_original(blob, part)
    L, thetas = part.num_layers, doc["head"]["rope_thetas"]
    offset = 0
    for index, frame in enumerate(parse_frames(blob, header)):
        n = len(frame.token_ids)
        e = min(max(1 - 64 * index, 0), n)
        body = bytes(frame.body)
        exact = shared.check_exact_tokens(body, original, offset, e)
        kept, symbols, offsets = _documented_body(body, doc, x, L, exact, n - e)
        chosen = 0
        for s, (comps, sym) in enumerate(zip(kept, symbols)):
            i, k = divmod(s, 2)
            radius = doc["radius"][x, i, k][comps].astype(np.float32)
            assert np.all(sym <= 2 * radius[:, None])
            shift = offsets[chosen : chosen + len(comps)].astype(np.float32) / 4
            chosen += len(comps)
            y = (sym.T.astype(np.float32) - radius + shift) * doc["steps"][x, i, k][comps]
            rows = y @ doc["components"][i, k][comps] + doc["mean"][i, k]
            positions = np.arange(64 * index + e, 64 * index + n)
            coded = got[k, i, :, offset + e : offset + n]
            shared.check_synthesized(rows, coded, thetas[i] if k == 0 else 0, positions)
        offset += n
    assert offset == part.num_tokens


def test_truncated_flipped_and_impossible_packed_frames_are_refused(kv, tiny_llama, model_file):
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64)
    blob = codec.encode(kv.slice(0, 100), level=LEVELS[-1], form="packed")
    shared.check_truncated_and_flipped_are_refused(blob)
    body = bytes(parse_frames(blob, parse_header(blob))[0].body)
    exact = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * 2  # the first token, bf16
    kept = int(np.count_nonzero(model_file.radius[model_file.level_index(LEVELS[-1])]))
    lows, widths = exact + kept, exact + 2 * kept

    def with_byte(at: int, value: int) -> bytes:
        return body[:at] + bytes([value]) + body[at + 1 :]

    wide = int(np.argmax(np.frombuffer(body, np.uint8, kept, widths)))
    for bad_body, why in (
        (body[:-1], "do not add up"),
        (body + b"\0", "do not add up"),
        (body[: exact + kept], "too short"),
        (with_byte(widths + wide, 9), "widths do not fit"),
        (with_byte(lows, 255), "lows or widths do not fit"),
        (with_byte(exact, 0x80), "offsets hold -128"),  # past the integer product's bound
    ):
        with pytest.raises(CodecError, match=why):
            decode(shared.reframe(blob, bad_body))


def test_the_packed_form_needs_no_rans_tables(kv, tiny_llama, model_file, monkeypatch):
    """Decoding it reads no table row: the unpacking stands in for the rANS pass."""
    from cachegen.codec.tcq import kernels as tcq_kernels

    blob = codec_for("tcq", tiny_llama, chunk_tokens=64).encode(kv, level=22, form="packed")

    def no_rans(*args):
        raise AssertionError("the packed form ran the rANS decoder")

    monkeypatch.setattr(tcq_kernels, "decode_coefficients", no_rans)
    assert decode(blob).num_tokens == kv.num_tokens
