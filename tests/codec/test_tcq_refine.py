"""tcq's refined rows: attention sinks' keys and values coded a quarter step finer, the
frames that carry them, and bad input in their section."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError, decode, get_codec
from cachegen.codec.coding.bitstream import parse_frames, parse_header
from cachegen.codec.tcq import codec as tcq
from cachegen.codec.tcq import decode as tcq_decode
from cachegen.codec.tcq import refine as tcq_refine
from cachegen.fitting.tcq import ensure_tcq_model
from tests.codec import transform_support as shared
from tests.codec.test_int_synthesis import needs_kernel
from tests.codec.test_tcq import BY_STEP

SINKS = (5, 17, 40)  # tokens whose values are made small


@pytest.fixture(scope="module")
def model_file(tiny_llama, profiles):
    return ensure_tcq_model(tiny_llama)


@pytest.fixture(scope="module")
def sunk(kv):
    """``kv`` with the values of tokens ``SINKS`` a tenth as large, as attention sinks'."""
    values = kv.values.clone()
    values[:, :, list(SINKS)] *= 0.1
    return dataclasses.replace(kv, values=values)


def _codecs(model_file, chunk_tokens=64):
    refined = get_codec("tcq", tcq=model_file, chunk_tokens=chunk_tokens)
    return refined, get_codec("tcq", tcq=model_file, chunk_tokens=chunk_tokens, refine=False)


def _row_errors(decoded, kv) -> torch.Tensor:
    """Squared error of each (layer, token) row, keys and values, [layers, tokens]."""
    error = (decoded.keys.float() - kv.keys.float()) ** 2
    error = error + (decoded.values.float() - kv.values.float()) ** 2
    return error.sum(dim=(1, 3))


def test_the_rows_of_small_values_are_found():
    values = torch.ones(2, 3, 10, 4)
    values[0, :, 3] *= 0.4
    values[1, 1, 7] *= 0.2  # one head alone: the mean over heads is 0.73 of the median
    values[1, :, 8] *= 0.45
    rows = tcq_refine.refined_rows(values)
    assert rows.tolist() == [[i == 3 for i in range(10)], [i == 8 for i in range(10)]]
    assert not tcq_refine.refined_rows(values[:, :, :1]).any()  # one token: nothing to compare


def test_sink_rows_decode_a_quarter_step_finer_and_the_others_alike(sunk, model_file):
    refined, plain = _codecs(model_file)
    level = BY_STEP[1]
    fine, coarse = decode(refined.encode(sunk, level)), decode(plain.encode(sunk, level))
    fine_err, coarse_err = _row_errors(fine, sunk), _row_errors(coarse, sunk)
    sinks = list(SINKS)
    assert float(fine_err[:, sinks].sum()) < 0.2 * float(coarse_err[:, sinks].sum())
    others = [t for t in range(sunk.num_tokens) if t not in SINKS]
    # rows not refined decode bit for bit as without refinement, but for the odd sink that
    # a layer's own values did not single out
    same = (fine.keys[:, :, others] == coarse.keys[:, :, others]).all(dim=(1, 3))
    assert float(same.float().mean()) >= 0.99


def test_refined_rows_cost_few_bits(sunk, model_file):
    refined, plain = _codecs(model_file)
    level = BY_STEP[1]
    assert len(refined.encode(sunk, level)) < 1.1 * len(plain.encode(sunk, level))


def test_a_layer_subset_of_a_refined_stream_decodes_to_the_same_values(sunk, model_file):
    refined, _ = _codecs(model_file)
    level, layers = BY_STEP[1], [1, 2]
    full = decode(refined.encode(sunk, level))
    part = decode(refined.encode(sunk.select_layers(layers), level))
    assert torch.equal(part.keys, full.keys[layers]) and torch.equal(
        part.values, full.values[layers]
    )


def test_unrefined_streams_still_decode(sunk, model_file):
    _, plain = _codecs(model_file)
    blob = plain.encode(sunk, BY_STEP[1])
    assert parse_header(blob).version == tcq.ADAPTIVE_BITSTREAM_VERSION
    assert shared.relative_error(decode(blob), sunk) < 0.5


def _section(model_file, sunk):
    """A refined stream of ``sunk`` (one 64-token frame), its first frame body, and where the
    body's refinement section starts."""
    refined, _ = _codecs(model_file)
    return _section_of(refined.encode(sunk.slice(0, 64), BY_STEP[1]), sunk)


def test_a_refinement_section_out_of_order_is_refused(sunk, model_file):
    import zlib

    blob, body, at = _section(model_file, sunk)
    (size,) = struct.unpack_from("<I", body, at)
    assert size > 0
    (packed,) = struct.unpack_from("<I", body, at + 5)
    mask = zlib.decompress(body[at + 9 : at + 9 + packed])
    end = at + 4 + size
    words = body[at + 9 + packed : end]

    def with_section(table: int, mask_bytes: bytes, rans_words: bytes) -> bytes:
        raw = zlib.compress(mask_bytes)
        section = bytes([table]) + struct.pack("<I", len(raw)) + raw + rans_words
        return body[:at] + struct.pack("<I", len(section)) + section + body[end:]

    flipped = bytearray(words)
    flipped[-1] ^= 0x40
    past = bytearray(mask)
    past[-1] |= 0x80  # 63 rows of 3 layers: bit 189 is past them
    for bad_body, why in (
        (with_section(len(model_file.family), mask, words), "a table the family does not have"),
        (with_section(body[at + 4], mask + b"\0", words), "one bit per row"),
        (with_section(body[at + 4], bytes(past), words), "bits past its rows"),
        (with_section(body[at + 4], bytes(len(mask)), words), "no refined row"),
        (with_section(body[at + 4], mask, bytes(flipped)), "does not decode|corrupt"),
        (with_section(body[at + 4], mask, words[:-2]), "does not decode|corrupt"),
        (body[:at] + struct.pack("<I", size + 2) + body[at + 4 :], "corrupt"),
        (body[:at] + struct.pack("<I", 1 << 30) + body[at + 4 :], "runs past the body"),
    ):
        with pytest.raises(CodecError, match=why):
            decode(shared.reframe(blob, bad_body))


def test_a_frame_without_sinks_has_an_empty_section(kv, model_file):
    refined, _ = _codecs(model_file)
    flat = dataclasses.replace(kv, values=torch.ones_like(kv.values))
    blob = refined.encode(flat.slice(0, 64), BY_STEP[1])
    _, body, at = _section_of(blob, flat)
    assert struct.unpack_from("<I", body, at)[0] == 0
    assert shared.relative_error(decode(blob), flat.slice(0, 64)) < 0.5


def _section_of(blob, kv):
    """``blob``, its first frame body and where the body's refinement section starts."""
    body = bytes(parse_frames(blob, parse_header(blob))[0].body)
    exact = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * 2  # the first token, bf16
    (side,) = struct.unpack_from("<I", body, exact)
    return blob, body, exact + 4 + side


def test_the_refinement_table_is_the_cheapest_of_the_family(model_file):
    freq_cum, _ = tcq_refine.refinement_tables(model_file)
    rng = np.random.default_rng(0)
    symbols = np.clip(np.round(rng.normal(2, 0.6, 500)), 0, 4).astype(np.uint8)
    mask = np.zeros((1, 8), dtype=bool)
    mask[0, 3] = True
    section = tcq_refine.encode_refinement(model_file, mask, [symbols[:, None], symbols[:0, None]])
    freq = (freq_cum >> 16).astype(np.float64) / 1024
    bits = -np.log2(freq) @ np.bincount(symbols, minlength=5)
    assert section[4] == int(np.argmin(bits))


@needs_kernel
def test_the_integer_product_refines_as_the_float_one(kv, model_file, monkeypatch):
    """Refinements added to the float product's coefficients, or by the integer kernel as
    corrections of the rows it wrote (20 sinks: a layer's rows fill whole tiles of the kernel's
    loops and leave some rows over)."""
    values = kv.values.clone()
    values[:, :, 2:42:2] *= 0.1
    many = dataclasses.replace(kv, values=values)
    blob, _ = _codecs(model_file)
    blob = blob.encode(many, BY_STEP[1])
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: False)
    decoded = {}
    for integer in (True, False):
        monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda integer=integer: integer)
        decoded[integer] = decode(blob, torch.float32)
    for got, want in (
        (decoded[True].keys, decoded[False].keys),
        (decoded[True].values, decoded[False].values),
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))
    plain = decode(_codecs(model_file)[1].encode(many, BY_STEP[1]), torch.float32)
    sinks = list(range(2, 42, 2))
    assert float(_row_errors(decoded[True], many)[:, sinks].sum()) < 0.2 * float(
        _row_errors(plain, many)[:, sinks].sum()
    )


def test_eval_takes_a_level_without_refined_rows(kv, tiny_llama, model_file):
    from cachegen.errors import InputError
    from cachegen_lab.quality.candidates import codec_candidates

    level = str(BY_STEP[1])
    plain, refined = codec_candidates(tiny_llama, "tcq", [f"{level}-unrefined", level])
    assert (plain.level, plain.options, refined.options) == (
        f"{level}-unrefined",
        {"refine": False},
        {},
    )
    (_, plain_bits), (_, refined_bits) = plain.roundtrip(kv), refined.roundtrip(kv)
    unrefined = get_codec("tcq", tcq=model_file, refine=False).encode(kv, BY_STEP[1])
    assert plain_bits == pytest.approx(8 * len(unrefined)) and plain_bits < refined_bits
    with pytest.raises(InputError, match="unrefined"):
        codec_candidates(tiny_llama, "tcq", ["7-unrefined"])
