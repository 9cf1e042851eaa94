"""The ``tcq`` codec: PCA transform, weighted uniform quantizers, per-component rANS tables;
its model file, round trips, size accounting and bad input."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError, available_codecs, decode, get_codec, inspect
from cachegen.codec.coding import rans
from cachegen.codec.coding.bitstream import parse_frames, parse_header
from cachegen.codec.tcq import code as tcq_code
from cachegen.codec.tcq import codec as tcq
from cachegen.codec.tcq import decode as tcq_decode
from cachegen.codec.tcq import encode as tcq_encode
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.fitting.attention import LayerStats, attention_probabilities, layer_weights
from cachegen.fitting.tcq import ensure_tcq_model, fit_tcq_model, tcq_calibration_spec
from cachegen.kv import KVCache
from cachegen.profiles import codec_for
from tests.codec import transform_support as shared
from tests.codec.transform_support import f32, relative_error

# levels from the most bits per element (the finest step) to the fewest
BY_STEP = sorted(tcq_model.LEVELS, key=lambda level: -tcq_model.LEVELS[level])


@pytest.fixture(scope="module")
def model_file(tiny_llama, profiles) -> tcq_model.TcqModel:
    return ensure_tcq_model(tiny_llama)


@pytest.fixture(scope="module")
def predicted(tiny_llama, profiles) -> tcq_model.TcqModel:
    """A model file of the default recipe plus the cross-layer predictor (saved)."""
    return tcq_model.save_tcq_model(fit_tcq_model(tiny_llama, prediction=True))


def test_tcq_is_registered():
    assert "tcq" in available_codecs()
    with pytest.raises(CodecError, match="needs a model"):
        get_codec("tcq").levels  # noqa: B018


def test_round_trip_error_and_size_fall_and_rise_with_the_step(kv, tiny_llama, model_file):
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64)
    errors, bits = [], []
    for level in BY_STEP:
        blob = codec.encode(kv, level=level)
        out = decode(blob, out_dtype=torch.float32)
        assert out.keys.shape == kv.keys.shape and out.keys.dtype == torch.float32
        assert torch.equal(out.keys[:, :, 0], kv.keys[:, :, 0].float())  # the sink token, exact
        assert torch.equal(out.values[:, :, 0], kv.values[:, :, 0].float())
        assert torch.equal(out.token_ids, kv.token_ids)
        errors.append(relative_error(out, kv))
        bits.append(inspect(blob)["bits_per_element"])
    # plain relative error: the weights spend the bits where the attention output needs them
    assert errors == sorted(errors) and errors[0] < 0.5
    assert bits == sorted(bits, reverse=True)


def test_a_layer_subset_decodes_to_the_same_values(kv, tiny_llama, model_file):
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64)
    level = BY_STEP[0]
    full = decode(codec.encode(kv, level=level))
    part = decode(codec.encode(kv.select_layers([1]), level=level))
    assert part.layers == (1,)
    assert torch.equal(part.keys[0], full.keys[1]) and torch.equal(part.values[0], full.values[1])


@pytest.fixture(scope="module")
def static_model(model_file, profiles) -> tcq_model.TcqModel:
    """The model file as format version 1 wrote it: no table family, frames without choices."""
    import dataclasses

    old = dataclasses.replace(
        model_file,
        family=np.zeros((0, tcq_model.MAX_RADIUS + 1), np.uint32),
        predictor=np.zeros((0, 2, 0, 0), np.float16),
        predictor_shift=np.zeros((0, 0), np.uint8),
    )
    return tcq_model.save_tcq_model(old)


def test_without_a_family_each_token_decodes_alike_in_any_chunking(kv, static_model):
    """Frames without choices have no per-chunk state: a token's symbols depend on the token
    and its position only.

    The projection onto the basis and the synthesis are matrix products (float32, or bf16
    where the CPU synthesizes in bf16), whose rounding depends on the number of rows and
    threads (oneDNN and MKL block differently, and with AMX differently again), so a
    coefficient that lies on a quantizer boundary may round either way: the odd token row
    differs. A per-chunk offset would change nearly every row."""
    full = decode(get_codec("tcq", tcq=static_model, chunk_tokens=64).encode(kv, BY_STEP[1]))
    tail = kv.slice(40, kv.num_tokens)
    out = decode(get_codec("tcq", tcq=static_model, chunk_tokens=32).encode(tail, BY_STEP[1]))
    assert out.start == 40
    for got, want in ((out.keys, full.keys[:, :, 40:]), (out.values, full.values[:, :, 40:])):
        rows_differing = (got != want).any(dim=-1).float().mean().item()  # [layer, head, token]
        assert rows_differing <= 0.01, f"{rows_differing:.1%} of token rows differ"


def test_frames_without_choices_still_decode(kv, static_model, model_file, monkeypatch):
    """A stream written before the choices (16-byte parameters, format version 1) decodes
    with its version 1 model file, which reads and writes back byte for byte."""
    monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda: False)  # float32's arithmetic
    blob = get_codec("tcq", tcq=static_model).encode(kv, BY_STEP[1])
    header = parse_header(blob)
    assert (header.version, header.params.hex()) == (1, static_model.id)
    again = tcq_model.parse_tcq_model(static_model.file_bytes, "test", static_model.id)
    assert not again.adaptive and again.file_bytes == static_model.file_bytes
    old = decode(blob, torch.float32)
    ref = reference_decode(static_model, kv, BY_STEP[1], None)
    got = torch.stack([old.keys, old.values])[:, :, :, 1:]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_choices_follow_a_shift_and_a_spread_the_calibration_never_saw(kv, static_model):
    """Text unlike the calibration text moves and widens the coefficients: the offsets and
    the family's tables code it in fewer bits than the calibrated tables, at no more error."""
    import dataclasses

    moved = dataclasses.replace(kv, keys=kv.keys * 1.5 + 0.5, values=kv.values * 1.5 - 0.5)
    level = BY_STEP[2]
    old = get_codec("tcq", tcq=static_model).encode(moved, level)
    new = codec_for("tcq", static_model.model.name).encode(moved, level)
    assert parse_header(new).version == tcq.REFINED_BITSTREAM_VERSION
    assert len(new) < 0.9 * len(old)
    assert relative_error(decode(new), moved) <= 1.02 * relative_error(decode(old), moved)


def test_each_component_takes_the_table_that_codes_it_in_the_fewest_bits(model_file):
    """The chooser against brute force: every option's bits counted from its table."""
    code = tcq_code.level_code(model_file, BY_STEP[1])
    rng = np.random.default_rng(0)
    for layer, kind in [(0, 0), (1, 1), (len(code.kept) - 1, 0)]:
        radius = code.radius[layer][kind]
        # even components drawn from their calibrated table, odd ones narrower than it: each
        # kind of table wins somewhere
        base = int(code.table_base[layer, kind])
        sym = np.empty((len(radius), 300), dtype=np.uint8)
        for c, r in enumerate(radius):
            freq = (code.freq_cum[base + c, : 2 * r + 1] >> 16).astype(np.float64)
            if c % 2:
                sym[c] = np.clip(np.round(rng.normal(0, 0.4, 300)), -r, r) + r
            else:
                sym[c] = rng.choice(2 * r + 1, size=300, p=freq / freq.sum())
        rows = code.calibrated_rows(layer, kind, predicted=False)
        choice = tcq_encode.choose_tables(code, rows, radius, sym)
        for c, r in enumerate(radius):
            first = code.family_row[r]
            rows = [base + c] + list(range(first, first + code.family_size))
            bits = [code.code_bits[row][sym[c]].sum() for row in rows]
            assert bits[choice[c]] == pytest.approx(min(bits), rel=1e-12), (layer, kind, c)
        assert 0 < np.count_nonzero(choice) < len(choice)


def test_each_token_decodes_as_closely_in_any_chunking(kv, tiny_llama, model_file):
    """Offsets are chosen per frame, so another chunking moves the quantizer's grid by a
    fraction of a step: the values change, not the error."""
    full = decode(codec_for("tcq", tiny_llama, chunk_tokens=64).encode(kv, level=BY_STEP[1]))
    tail = kv.slice(40, kv.num_tokens)
    out = decode(codec_for("tcq", tiny_llama, chunk_tokens=32).encode(tail, level=BY_STEP[1]))
    assert out.start == 40
    want = kv.slice(40, kv.num_tokens)
    assert relative_error(out, want) == pytest.approx(
        relative_error(full.slice(40, kv.num_tokens), want), rel=0.1
    )


def reference_decode(
    model: tcq_model.TcqModel,
    kv: KVCache,
    level: int,
    chunk_tokens: int | None,
    magnitude: bool = False,
    sums: bool = False,
) -> torch.Tensor:
    """Tokens 1.. of ``kv`` through the encoder's quantizer (its offsets chosen per chunk of
    ``chunk_tokens``; None: a model without a family, no offsets) and back by the model
    file's arithmetic, plainly in torch: ``mean +
    ((sym - radius + offset / 4) * step) @ components[kept]``, keys turned by their rotary
    angles; float32 [2, L, H, n - 1, D]. With ``magnitude``: the sum of the product's terms'
    magnitudes instead, ``(|sym - radius| + |offset / 4|) * step @ |components[kept]|`` (no
    mean, nothing turned), what bounds the rounding of the product's terms. With ``sums``: each
    token's ``sum(|sym - radius| + |offset / 4|)`` over the kept components (no step), in every
    channel of its stream, what bounds the rounding of the integer synthesis's entries."""
    code = tcq_code.level_code(model, level)
    x = f32(kv)[:, :, :, 1:]
    L, H, n, D = x.shape[1:]
    keys = rotate_layer_keys(x[0], 1, model.rope_thetas, inverse=True)
    out = torch.empty_like(x)
    step = chunk_tokens or kv.num_tokens
    bounds = list(range(0, kv.num_tokens, step))[1:] + [kv.num_tokens]
    for layer in range(L):
        for k, source in enumerate((keys, x[1])):
            rows = source[layer].permute(1, 0, 2).reshape(n, H * D)
            radius = torch.from_numpy(code.radius[layer][k]).float()
            basis = torch.from_numpy(model.components[layer, k][code.kept[layer][k]])
            coefficients = []
            for a, b in zip([1, *bounds[:-1]], bounds):  # token 0 is exact
                part = rows[a - 1 : b - 1]
                sym, offset, _ = tcq_encode.quantize_rows(
                    model, code, layer, k, part, model.adaptive
                )
                centred = torch.from_numpy(sym.T.copy()).float() - radius
                if model.adaptive:  # the sinks' rows a quarter step finer
                    centred += _refinements(
                        model, code, layer, k, part, x[1, layer, :, a - 1 : b - 1]
                    )
                shift = torch.from_numpy(offset).float() / tcq_code.OFFSET_UNITS
                coefficients.append(
                    (centred.abs() + shift.abs()) if magnitude or sums else (centred + shift)
                )
            if sums:
                total = torch.cat(coefficients).sum(dim=-1, keepdim=True).expand(-1, H * D)
                out[k, layer] = total.reshape(n, H, D).permute(1, 0, 2)
                continue
            coefficients = torch.cat(coefficients) * code.step[layer][k]
            if magnitude:
                synthesized = coefficients @ basis.abs()
            else:
                synthesized = torch.from_numpy(model.mean[layer, k]) + coefficients @ basis
            out[k, layer] = synthesized.reshape(n, H, D).permute(1, 0, 2)
    if not (magnitude or sums):
        out[0] = rotate_layer_keys(out[0], 1, model.rope_thetas)
    return out


def _refinements(model, code, layer: int, k: int, part, values) -> torch.Tensor:
    """The refinements in steps [tokens, kept] of a frame's rows ``part`` of (layer, K/V)
    whose values are ``values`` [heads, tokens, head_dim]: ``r / 4`` on its refined rows."""
    from cachegen.codec.tcq import refine as tcq_refine

    sym, _, y = tcq_encode.quantize_rows(model, code, layer, k, part, True)
    fine = tcq_refine.refinement_symbols(y, sym, code.radius[layer][k]).astype(np.float32) - 2
    rows = tcq_refine.refined_rows(values[None])[0]
    return torch.from_numpy((fine * rows[None]).T.copy()) / tcq_refine.REFINE_UNITS


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bf16_gemm", [False, True], ids=["f32-synthesis", "bf16-synthesis"])
def test_decoder_matches_a_reference_synthesis(
    kv, tiny_llama, model_file, out_dtype, bf16_gemm, monkeypatch
):
    # the decoder's kernels (rANS to centred coefficients, one batched product, rotary and the
    # output dtype in one pass) against the arithmetic written plainly; only the order of the
    # float32 sums may differ, then the output's rounding. Both syntheses are forced, so
    # each is checked on any CPU (bf16 only ever applies to bf16 output); the int16 one is
    # checked in test_int_synthesis.py.
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: bf16_gemm)
    monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda: False)
    assert any(model_file.rope_thetas)  # keys are turned
    level = BY_STEP[1]
    out = decode(codec_for("tcq", tiny_llama, chunk_tokens=64).encode(kv, level), out_dtype)
    got = torch.stack([out.keys, out.values])[:, :, :, 1:].float()
    ref = reference_decode(model_file, kv, level, 64)
    scale = float(ref.abs().max())
    if out_dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * scale)
    elif out_dtype == torch.bfloat16 and bf16_gemm:
        # each synthesis entry and the product are rounded to bf16 (a unit roundoff, 2**-8,
        # of the terms' magnitudes each), a key's pair of channels mixed by its rotation,
        # then the output rounded (2**-8 of its magnitude)
        terms = reference_decode(model_file, kv, level, 64, magnitude=True)
        half = terms.shape[-1] // 2
        terms[0] = terms[0] + torch.cat([terms[0][..., half:], terms[0][..., :half]], dim=-1)
        bound = 2.0**-7 * terms + 2.0**-8 * ref.abs() + 1e-5 * scale
        excess = float(((got - ref).abs() - bound).max())
        assert excess <= 0, f"an element is {excess:.3g} beyond the bf16 synthesis's bound"
    else:  # one rounding to the output dtype, half an ulp, plus the float32 differences
        ulp = 2.0**-7 if out_dtype == torch.bfloat16 else 2.0**-10
        torch.testing.assert_close(got, ref, rtol=ulp, atol=1e-5 * scale)
        # rounded to nearest: the same value as the reference's rounding but near ties
        assert float((got != ref.to(out_dtype).float()).float().mean()) < 0.01


def test_bits_per_element_counts_every_byte(kv, tiny_llama, model_file):
    blob = codec_for("tcq", tiny_llama).encode(kv, level=BY_STEP[-1])
    info, _ = shared.check_every_byte_is_counted(blob, kv)
    assert info["transform"] == model_file.id and info["transform_bytes"] == model_file.nbytes
    assert 0 < info["table_bytes"] < model_file.nbytes


def test_model_is_fitted_on_the_calibration_split_only(tiny_llama, profiles, monkeypatch):
    fitted, read = shared.fit_recording_splits(monkeypatch, lambda: fit_tcq_model(tiny_llama))
    assert set(read) == {"calibrate"}
    assert fitted.calibration == tcq_calibration_spec(spec=tiny_llama)


def test_steps_follow_the_weights_and_never_need_clipping(model_file):
    for index, (key_step, value_step) in enumerate(model_file.levels.values()):
        nominal = np.array([key_step, value_step])[None, :, None] / np.sqrt(model_file.weights)
        steps = model_file.steps[index]
        assert np.all(steps >= nominal * (1 - 1e-6))
        assert int(model_file.radius[index].max()) <= tcq_model.MAX_RADIUS
        # coarser than nominal only where the radius would otherwise pass the alphabet
        coarser = steps > nominal * (1 + 1e-5)
        assert np.all(model_file.radius[index][coarser] == tcq_model.MAX_RADIUS)


def test_attention_probabilities_are_causal_and_windowed():
    keys = torch.zeros(6, 2)
    a = attention_probabilities(torch.zeros(2, 2), torch.tensor([2, 5]), keys, 1.0, None)
    assert torch.allclose(a[0], torch.tensor([1 / 3] * 3 + [0.0] * 3))
    assert torch.allclose(a[1], torch.full((6,), 1 / 6))
    a = attention_probabilities(torch.zeros(1, 2), torch.tensor([5]), keys, 1.0, 2)
    assert torch.allclose(a[0], torch.tensor([0.0] * 4 + [0.5] * 2))


def _one_head_layer(o_proj: torch.Tensor):
    from types import SimpleNamespace

    linear = torch.nn.Linear(o_proj.shape[1], o_proj.shape[0], bias=False)
    linear.weight.data = o_proj
    return SimpleNamespace(self_attn=SimpleNamespace(o_proj=linear, scaling=1.0))


def test_component_weights_follow_the_output_projection_and_the_queries():
    n, D = 8, 2
    o_proj = torch.tensor([[3.0, 0.0], [0.0, 1.0]])  # value channel 0 reaches the output 3x
    keys = torch.zeros(1, n, D)  # every token gets the same attention
    values = torch.randn(1, n, D, generator=torch.Generator().manual_seed(0))
    queries = torch.tensor([[[0.0, 2.0]] * 3])  # queries read key channel 1 only
    stats = LayerStats(queries, torch.tensor([5, 6, 7]), scale=2.0)
    layer, basis = _one_head_layer(o_proj), np.eye(D)[None].repeat(2, 0)
    key_w, value_w = layer_weights(layer, stats, keys, values, 0.0, None, basis, 1.0)
    assert key_w[0] == 0 and key_w[1] > 0
    assert value_w[0] == pytest.approx(9 * value_w[1])
    # a value error reaches the output through the attention weights, squared
    rows = [(p, 1 / (p + 1)) for p in (5, 6, 7)]
    a2 = np.mean([p * w**2 for p, w in rows])  # token 0 is exact
    assert value_w[1] == pytest.approx(a2 * 1.0 / stats.scale, rel=1e-5)
    # ... relative to the layer's scale to the layer exponent
    _, half = layer_weights(layer, stats, keys, values, 0.0, None, basis, 0.5)
    assert half[1] == pytest.approx(a2 / stats.scale**0.5, rel=1e-5)


def test_model_file_round_trips_and_is_content_addressed(model_file, profiles):
    again = shared.read_back(
        model_file, tcq_model.tcq_model_path(model_file.id), tcq_model.parse_tcq_model
    )
    assert np.array_equal(again.freq, model_file.freq)
    shared.check_reference(
        tcq_model.tcq_ref_path(model_file.model), tcq_model, "model_file", model_file.id
    )


def test_corrupt_model_file_is_detected_by_its_checksum(kv, tiny_llama, model_file, profiles):
    blob = codec_for("tcq", tiny_llama).encode(kv, level=BY_STEP[0])
    path = tcq_model.tcq_model_path(model_file.id)
    shared.check_corrupt_file_is_detected(blob, kv.num_tokens, path, tcq_model.parse_tcq_model)


def _rehashed(data: bytes, payload: bytes) -> bytes:
    """A model file with ``payload`` and a header whose checksum matches it."""
    (length,) = struct.unpack_from("<I", data, 4)
    header = json.loads(data[8 : 8 + length])
    header["payload_sha256"] = hashlib.sha256(payload).hexdigest()
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return tcq_model.MAGIC + struct.pack("<I", len(raw)) + raw + payload


def test_model_file_with_a_bad_table_is_refused(predicted):
    model_file = predicted  # every kind of table: calibrated, family, residual
    data = model_file.file_bytes
    (length,) = struct.unpack_from("<I", data, 4)
    payload = bytearray(data[8 + length :])
    residual = 2 * model_file.residual_freq.size
    assert residual  # the fit predicted some layer
    after_family = 2 * model_file.predictor.size + model_file.predictor_shift.size + residual
    family_at = len(payload) - after_family - 4 * model_file.family.size
    first_table = family_at - 2 * model_file.freq.size
    struct.pack_into("<H", payload, first_table, model_file.freq[0] + 1)
    with pytest.raises(CodecError, match=f"does not sum to {rans.PROB_SCALE}"):
        tcq_model.parse_tcq_model(_rehashed(data, bytes(payload)), "test")
    with pytest.raises(CodecError, match="do not match the radii"):
        tcq_model.parse_tcq_model(_rehashed(data, bytes(payload[:-2])), "test")
    payload = bytearray(data[8 + length :])
    struct.pack_into("<H", payload, len(payload) - residual, model_file.residual_freq[0] + 1)
    with pytest.raises(CodecError, match=f"a residual table does not sum to {rans.PROB_SCALE}"):
        tcq_model.parse_tcq_model(_rehashed(data, bytes(payload)), "test")
    payload = bytearray(data[8 + length :])
    centre = family_at  # the family's first weight
    struct.pack_into("<I", payload, centre, 0)
    with pytest.raises(CodecError, match="each with a centre"):
        tcq_model.parse_tcq_model(_rehashed(data, bytes(payload)), "test")


def test_model_of_another_model_or_level_is_refused(kv, tiny_llama, tiny_qwen2, model_file):
    codec = codec_for("tcq", tiny_llama)
    shared.check_another_model_is_refused(
        codec, kv, tiny_qwen2, lambda other: tcq_model.find_tcq_model(model_file.id, other)
    )
    # a bitstream naming a level its model file lacks
    blob = bytearray(codec.encode(kv, level=BY_STEP[0]))
    header = parse_header(bytes(blob))
    assert header.level == BY_STEP[0]
    with pytest.raises(CodecError, match="no level"):
        get_codec("tcq", tcq=model_file).decoder(_with_level(header, 7))


def test_a_frame_layout_the_header_cannot_hold_is_refused(
    kv, tiny_llama, model_file, static_model, predicted
):
    import dataclasses

    plain = get_codec("tcq", tcq=model_file, refine=False)
    header = parse_header(plain.encode(kv, level=BY_STEP[0]))
    assert header.version == tcq.ADAPTIVE_BITSTREAM_VERSION and header.params[16] == 1
    with_prediction = get_codec("tcq", tcq=predicted, refine=False)
    coded = parse_header(with_prediction.encode(kv, level=BY_STEP[0]))
    assert coded.version == tcq.PREDICTED_BITSTREAM_VERSION and coded.params[16] == 3
    packed = parse_header(with_prediction.encode(kv, level=BY_STEP[0], form="packed"))
    assert packed.version == tcq.ADAPTIVE_BITSTREAM_VERSION and packed.params[16] == 1
    refined = parse_header(codec_for("tcq", tiny_llama).encode(kv, level=BY_STEP[0]))
    assert refined.version == tcq.REFINED_BITSTREAM_VERSION and refined.params[16] == 5
    both = parse_header(get_codec("tcq", tcq=predicted).encode(kv, level=BY_STEP[0]))
    assert both.version == tcq.REFINED_BITSTREAM_VERSION and both.params[16] == 7
    cases = [
        (dataclasses.replace(header, version=4), "frame layout"),  # choices need version 5
        (dataclasses.replace(coded, version=5), "frame layout"),  # predictions need version 6
        (dataclasses.replace(refined, version=6), "frame layout"),  # refined rows need 7
        (dataclasses.replace(both, version=6), "frame layout"),
        (dataclasses.replace(refined, form="packed"), "frame layout"),  # packed never refines
        (dataclasses.replace(header, params=header.params[:16] + b"\x02"), "frame layout"),
        (dataclasses.replace(refined, params=refined.params[:16] + b"\x0d"), "frame layout"),
        (dataclasses.replace(coded, form="packed"), "frame layout"),  # packed never predicts
        (dataclasses.replace(header, params=header.params + b"\x01"), "parameters"),
        # choices, but the model file named has no family to choose from
        (dataclasses.replace(header, params=bytes.fromhex(static_model.id) + b"\x01"), "family"),
        # predicted frames, but the model file named has no predictor
        (dataclasses.replace(coded, params=bytes.fromhex(model_file.id) + b"\x03"), "predictor"),
    ]
    for forged, why in cases:
        with pytest.raises(CodecError, match=why):
            tcq.TcqCodec.decoder(forged)


def _with_level(header, level: int):
    import dataclasses

    return dataclasses.replace(header, level=level)


def test_truncated_and_flipped_frames_are_refused(kv, tiny_llama, model_file):
    # refined frames' own section: tests/codec/test_tcq_refine.py
    shared.check_truncated_and_flipped_are_refused(
        codec_for("tcq", tiny_llama, chunk_tokens=64).encode(kv.slice(0, 100), BY_STEP[0])
    )
    codec = get_codec("tcq", tcq=model_file, chunk_tokens=64, refine=False)
    blob = codec.encode(kv.slice(0, 100), level=BY_STEP[0])
    shared.check_truncated_and_flipped_are_refused(blob)
    body = bytes(parse_frames(blob, parse_header(blob))[0].body)
    exact = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * 2  # the first token, bf16
    (side,) = struct.unpack_from("<I", body, exact)
    choices = zlib.decompress(body[exact + 4 : exact + 4 + side])
    # a directory that still adds up but moves a word from one stream to the next
    shifted = bytearray(body)
    directory = exact + 4 + side
    first, second = struct.unpack_from("<2I", shifted, directory)
    struct.pack_into("<2I", shifted, directory, first + 1, second - 1)

    # choices that inflate but name a table past the family, or are one entry short
    def with_choices(raw: bytes) -> bytes:
        packed = zlib.compress(raw)
        return body[:exact] + struct.pack("<I", len(packed)) + packed + body[directory:]

    past = choices[:-1] + bytes([len(model_file.family) + 1])
    garbage = body[:exact] + struct.pack("<I", side) + bytes(side) + body[directory:]
    for bad_body, why in (
        (body[:-2], "corrupt"),
        (body + b"\0\0", "corrupt"),
        (bytes(shifted), "corrupt"),
        (with_choices(past), "a table the family does not have"),
        (with_choices(b"\x80" + choices[1:]), "offsets hold -128"),
        (with_choices(choices[:-1]), "one entry per kept component"),
        (with_choices(choices + b"\0"), "one entry per kept component"),
        (garbage, "do not inflate"),
    ):
        with pytest.raises(CodecError, match=why):
            decode(shared.reframe(blob, bad_body))


def test_codec_needs_a_model_file_and_never_fits_one(tiny_opt, profiles):
    from cachegen.extract import extract_kv

    other = extract_kv(tiny_opt, text="No model file was fitted for this model. " * 4)
    with pytest.raises(CodecError, match="no tcq model"):
        get_codec("tcq").encode(other)


def test_cli_eval_rows_for_tcq(capsys, tmp_path, tiny_llama, model_file):
    rows = shared.cli_eval_rows(capsys, tmp_path, ["tcq"])
    assert rows == [("tcq", str(level)) for level in sorted(tcq_model.LEVELS)]


def _documented_rans(words: np.ndarray, tables: list[np.ndarray], tokens: int) -> np.ndarray:
    """Symbols ``[tokens, len(tables)]`` of one rANS stream, decoded as docs/bitstream.md says:
    8 lanes, lane ``i`` codes components ``i, i + 8, ...``; order: group, token, lane."""
    state = [int(words[2 * i]) | int(words[2 * i + 1]) << 16 for i in range(8)]
    cums = [np.concatenate([[0], np.cumsum(f)]) for f in tables]
    out, pos = np.empty((tokens, len(tables)), dtype=np.int64), 16
    for group in range(0, len(tables), 8):
        for t in range(tokens):
            for lane in range(min(8, len(tables) - group)):
                c, x = group + lane, state[lane]
                slot = x & (rans.PROB_SCALE - 1)
                s = int(np.searchsorted(cums[c], slot, side="right")) - 1
                x = int(tables[c][s]) * (x >> 10) + slot - int(cums[c][s])
                if x < 1 << 16:
                    x, pos = (x << 16) | int(words[pos]), pos + 1
                out[t, c], state[lane] = s, x
    assert pos == len(words) and state == [1 << 16] * 8
    return out


def _documented_refinement(body, at: int, doc, kept_of, values) -> tuple[int, dict]:
    """(bytes, refinements in steps [tokens, kept] per (layer, K/V)) of a frame's refinement
    section at byte ``at``, read as docs/bitstream.md says; its refined rows are those whose
    ``values`` [layers, heads, tokens, head_dim] norm, the mean over heads, is below half the
    layer's median."""
    import zlib

    L, m = values.shape[0], values.shape[2]
    norm = values.norm(dim=-1).mean(dim=1)
    mask = (norm < 0.5 * norm.median(dim=1, keepdim=True).values).numpy()
    fine = {(i, k): np.zeros((m, len(kept_of[i][k])), np.float32) for i in range(L) for k in (0, 1)}
    (size,) = struct.unpack_from("<I", body, at)
    if not size:
        assert not mask.any()
        return 4, fine
    table, packed = body[at + 4], struct.unpack_from("<I", body, at + 5)[0]
    bits = np.unpackbits(
        np.frombuffer(zlib.decompress(body[at + 9 : at + 9 + packed]), np.uint8), bitorder="little"
    )
    assert (
        np.array_equal(bits[: L * m].reshape(L, m).astype(bool), mask) and not bits[L * m :].any()
    )
    counts = [int(mask[i].sum()) * len(kept_of[i][k]) for i in range(L) for k in (0, 1)]
    words = np.frombuffer(body, "<u2", (size - 5 - packed) // 2, at + 9 + packed)
    tokens = -(-sum(counts) // 8)  # 8 lanes, the last token padded with symbol 2
    r = _documented_rans(words, [doc["family_table"](table, 2)] * 8, tokens).reshape(-1) - 2
    assert not r[sum(counts) :].any()
    for (i, k), start, count in zip(fine, np.cumsum([0] + counts), counts):
        rows = r[start : start + count].reshape(int(mask[i].sum()), -1)
        fine[i, k][mask[i]] = rows / 4
    return 4 + size, fine


def _documented_restore(doc, x, kept_of, symbols, offsets, first) -> None:
    """The predicted targets of a frame's decoded symbols back to their symbols, in place, in
    int64 by docs/bitstream.md's arithmetic (layer after layer, keys then values)."""
    T = doc["predictor"].shape[3]
    for i in range(1, len(kept_of)):
        shift = int(doc["predictor_shift"][x, i])
        if not shift:
            continue
        src, steps, rows = [], [], []
        for k in (0, 1):
            kept = kept_of[i - 1][k]
            if not len(kept):
                continue
            r = doc["radius"][x, i - 1, k][kept].astype(np.int64)
            o = offsets[first[2 * (i - 1) + k] : first[2 * (i - 1) + k + 1]].astype(np.int64)
            src.append(4 * (symbols[i - 1, k] - r) + o)
            steps.append(doc["steps"][x, i - 1, k][kept])
            rows.append(kept + k * doc["predictor"].shape[2] // 2)
        sources = np.concatenate(src, axis=1)
        source_steps = np.concatenate(steps).astype(np.float64)[:, None]
        for k in (0, 1):
            targets = kept_of[i][k][kept_of[i][k] < T]
            if not len(targets):
                continue
            weights = doc["predictor"][i, k].astype(np.float64)[np.concatenate(rows)][:, targets]
            target_steps = doc["steps"][x, i, k][targets].astype(np.float64)[None, :]
            scaled = weights * source_steps / target_steps
            matrix = np.round(scaled * 2.0**shift).astype(np.int64)
            o = offsets[first[2 * i + k] : first[2 * i + k] + len(targets)].astype(np.int64)
            total = sources @ matrix - o * 2**shift
            guess = np.round(total / 2.0 ** (shift + 2)).astype(np.int64)
            r = doc["radius"][x, i, k][targets].astype(np.int64)
            coded = symbols[i, k][:, : len(targets)] - r
            symbols[i, k][:, : len(targets)] = np.mod(coded + guess + r, 2 * r + 1)


def _documented_model_file(path, model_id: str) -> dict:
    """The arrays and JSON header of a CGTQ file, read by the documented layout."""
    data = path.read_bytes()
    assert data[:4] == b"CGTQ" and hashlib.sha256(data).hexdigest()[:32] == model_id
    (length,) = struct.unpack_from("<I", data, 4)
    head = json.loads(data[8 : 8 + length])
    assert data[8 : 8 + length] == json.dumps(head, sort_keys=True, separators=(",", ":")).encode()
    predicted = head["version"] == 3  # the predictor and residual tables follow the family
    assert set(head) == {"schema", "version", "model", "calibration", "rope_thetas", "levels"} | {
        "arrays",
        "freq_entries",
        "family",
        "payload_sha256",
    } | ({"predictor", "residual_freq_entries"} if predicted else set())
    assert head["schema"] == "cachegen-tcq-model" and head["version"] in (2, 3)
    payload = data[8 + length :]
    assert hashlib.sha256(payload).hexdigest() == head["payload_sha256"]
    m = head["model"]
    L, C, N = m["num_layers"], m["num_kv_heads"] * m["head_dim"], len(head["levels"])
    shapes = {"mean": (L, 2, C), "components": (L, 2, C, C), "weights": (L, 2, C)}
    shapes |= {"radius": (N, L, 2, C), "steps": (N, L, 2, C)}
    doc, pos = {"head": head, "levels": [int(k) for k in head["levels"]]}, 0
    for name, shape in shapes.items():
        assert head["arrays"][name] == list(shape)
        dtype = "u1" if name == "radius" else "<f4"
        count = int(np.prod(shape))
        doc[name] = np.frombuffer(payload, dtype, count, pos).reshape(shape)
        pos += count * np.dtype(dtype).itemsize
    sizes = np.where(doc["radius"] > 0, 2 * doc["radius"].astype(np.int64) + 1, 0)
    J, R = head["family"]
    P = head["predictor"] if predicted else [L, 2, 2 * C, 0]
    assert R == 128 and head["freq_entries"] == sizes.sum() and P[:3] == [L, 2, 2 * C]
    E = head["residual_freq_entries"] if predicted else 0
    tail = 2 * sizes.sum() + 4 * J * R + (2 * int(np.prod(P)) + N * L + 2 * E if predicted else 0)
    assert pos + tail == len(payload)
    assert len(data) == 8 + length + 8 * L * C * (C + 2) + 10 * N * L * C + tail
    freq = np.frombuffer(payload, "<u2", count=int(sizes.sum()), offset=pos)
    pos += 2 * int(sizes.sum())
    family = np.frombuffer(payload, "<u4", count=J * R, offset=pos).reshape(J, R)
    pos += 4 * J * R
    doc["predictor"] = np.frombuffer(payload, "<f2", int(np.prod(P)), pos).reshape(P)
    pos += 2 * int(np.prod(P))
    shifts = N * L if predicted else 0
    doc["predictor_shift"] = np.frombuffer(payload, "u1", shifts, pos).reshape(N, -1)
    residual = np.frombuffer(payload[pos + shifts :], "<u2")
    # the residual tables: per level, predicted layer (shift > 0) and K/V, one per kept
    # component below T, in that order
    doc["residual_tables"], at = {}, 0
    for x in range(N):
        for layer in range(L):
            for k in (0, 1):
                if not predicted or not doc["predictor_shift"][x, layer]:
                    continue
                for c in np.flatnonzero(doc["radius"][x, layer, k]):
                    if c >= P[3]:
                        break
                    n = 2 * int(doc["radius"][x, layer, k, c]) + 1
                    doc["residual_tables"][x, layer, k, c] = residual[at : at + n]
                    at += n
    assert at == E
    # a family table of radius r: the weights at |s| for s in -r..r, made frequencies
    # summing to 1024 with at least 1 each, as quantize_frequencies does
    doc["family_table"] = lambda j, r: rans.quantize_frequencies(
        family[j : j + 1, np.abs(np.arange(-r, r + 1))].astype(np.int64), np.array([2 * r + 1])
    )[0]
    ends = np.cumsum(sizes.reshape(-1)).reshape(sizes.shape)
    doc["tables"] = lambda x, layer, k, c: freq[ends[x, layer, k, c] - sizes[x, layer, k, c] :][
        : sizes[x, layer, k, c]
    ]
    return doc


@pytest.mark.parametrize("which", ["default", "predicted"])
def test_tcq_bitstream_and_model_file_follow_the_documented_layout(kv, which, request):
    import zlib

    model_file = request.getfixturevalue("model_file" if which == "default" else "predicted")
    part = kv.slice(0, 100)  # frame 0 starts at position 0: 1 exact token; frame 1 none
    level = BY_STEP[-1]  # the coarsest step: some components dropped
    blob = get_codec("tcq", tcq=model_file, chunk_tokens=64).encode(part, level=level)
    fixed = struct.unpack_from("<4sBBHBBHHHQII", blob, 0)
    magic, version, codec_id, got_level, dtype, flags, L, H, D, start, tokens, chunk = fixed
    layout = 7 if which == "predicted" else 5  # refined rows, with or without predictions
    assert (magic, version, codec_id, got_level, start, tokens, chunk) == (
        b"CGKV",
        7,
        12,
        level,
        0,
        100,
        64,
    )
    assert dtype == {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}[part.dtype]
    assert flags == 2 and (L, H, D) == (part.num_layers, part.num_kv_heads, part.head_dim)
    pos = 32 + 1 + blob[32]
    assert blob[33:pos].decode() == "tiny-llama" and blob[pos] == 32
    fingerprint = blob[pos + 1 : pos + 33].hex()
    pos += 33
    (p,) = struct.unpack_from("<H", blob, pos)
    params = blob[pos + 2 : pos + 2 + p]
    assert p == 17 and params[:16].hex() == model_file.id and params[16] == layout
    assert fingerprint == part.model.fingerprint
    pos += 2 + p
    assert struct.unpack_from("<I", blob, pos)[0] == zlib.crc32(blob[:pos])
    assert pos + 4 == 32 + 1 + len("tiny-llama") + 1 + 32 + 2 + 17 + 4
    pos += 4
    doc = _documented_model_file(tcq_model.tcq_model_path(model_file.id), model_file.id)
    x = doc["levels"].index(level)
    assert 0 < np.count_nonzero(doc["radius"][x]) < doc["radius"][x].size  # kept and dropped
    thetas = doc["head"]["rope_thetas"]
    decoded, got, original = shared.decoded_and_original(blob, part)
    offset = 0
    for index in range(2):
        length, crc = struct.unpack_from("<II", blob, pos)
        payload = blob[pos + 8 : pos + 8 + length]
        assert len(payload) == length and zlib.crc32(payload) == crc
        pos += 8 + length
        n = min(64, 100 - 64 * index)
        body = payload[2 * n :]
        e = min(max(1 - 64 * index, 0), n)
        m = n - e
        exact = shared.check_exact_tokens(body, original, offset, e)
        (side,) = struct.unpack_from("<I", body, exact)
        choices = zlib.decompress(body[exact + 4 : exact + 4 + side])
        kept_total = int(np.count_nonzero(doc["radius"][x]))
        assert len(choices) == 2 * kept_total
        offsets = np.frombuffer(choices, np.int8, kept_total)
        tables_of = np.frombuffer(choices, np.uint8, offset=kept_total)
        assert 0 < np.count_nonzero(tables_of) and np.count_nonzero(offsets)  # some chosen
        kept_of = [[np.flatnonzero(doc["radius"][x, i, k]) for k in (0, 1)] for i in range(L)]
        values = original[1, :, :, offset + e : offset + n].float()
        size, fine = _documented_refinement(body, exact + 4 + side, doc, kept_of, values)
        words = struct.unpack_from(f"<{2 * L}I", body, exact + 4 + side + size)
        at = exact + 4 + side + size + 8 * L
        assert at + 2 * sum(words) == len(body)
        first = np.cumsum([0] + [len(c) for pair in kept_of for c in pair])
        symbols = {}
        for i in range(L):
            for k in range(2):
                stream = np.frombuffer(body, "<u2", words[2 * i + k], at)
                at += 2 * words[2 * i + k]
                kept = kept_of[i][k]
                if not len(kept) or not m:
                    assert len(stream) == 0
                    continue
                radius = doc["radius"][x, i, k][kept]
                picks = tables_of[first[2 * i + k] : first[2 * i + k + 1]]
                own = [doc["residual_tables"].get((x, i, k, c)) for c in kept]  # predicted
                own = [t if t is not None else doc["tables"](x, i, k, c) for t, c in zip(own, kept)]
                tables = [
                    doc["family_table"](j - 1, int(r)) if j else table
                    for table, j, r in zip(own, picks, radius)
                ]
                symbols[i, k] = _documented_rans(stream, tables, m)
        if m:
            if doc["head"]["version"] == 3:
                _documented_restore(doc, x, kept_of, symbols, offsets, first)
        for (i, k), sym in symbols.items():
            kept = kept_of[i][k]
            radius = doc["radius"][x, i, k][kept].astype(np.float32)
            shift = offsets[first[2 * i + k] : first[2 * i + k + 1]].astype(np.float32) / 4
            y = (sym.astype(np.float32) - radius + shift + fine[i, k]) * doc["steps"][x, i, k][kept]
            rows = y @ doc["components"][i, k][kept] + doc["mean"][i, k]
            positions = np.arange(64 * index + e, 64 * index + n)
            coded = got[k, i, :, offset + e : offset + n]
            shared.check_synthesized(rows, coded, thetas[i] if k == 0 else 0, positions)
        offset += n
    assert pos == len(blob) and offset == part.num_tokens
    assert torch.equal(decoded.keys[:, :, :1], part.keys[:, :, :1].float())


def test_model_file_levels_stay_with_their_arrays(model_file):
    """The file's canonical JSON sorts level ids as text; the per-level arrays are in numeric
    order, so a reader takes the ids in numeric order, and a model out of order is refused."""
    import dataclasses

    ids = list(model_file.levels)
    assert ids == sorted(ids)
    renamed = dict(zip([9, *range(10, 10 + len(ids) - 1)], model_file.levels.values()))
    model = dataclasses.replace(model_file, levels=renamed)  # "10" sorts before "9" as text
    again = tcq_model.parse_tcq_model(model.file_bytes, "test", model.id)
    assert list(again.levels) == list(renamed)
    assert np.array_equal(again.steps, model.steps) and np.array_equal(again.radius, model.radius)
    with pytest.raises(CodecError, match="increasing order"):
        dataclasses.replace(model_file, levels=dict(reversed(list(renamed.items()))))


def test_model_file_whose_header_is_not_an_object_is_refused():
    data = tcq_model.MAGIC + struct.pack("<I", 2) + b"[]"
    with pytest.raises(CodecError):
        tcq_model.parse_tcq_model(data, "test", hashlib.sha256(data).hexdigest()[:32])
