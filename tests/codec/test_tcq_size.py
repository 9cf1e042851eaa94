"""What a tcq level costs per element, estimated from its model file alone
(``cachegen.codec.tcq.size``), against real encodings of held-out KV.

The estimate is for a chunk at the start of a prompt, from the calibrated tables, so it is
closest on text like the calibration text's: within 10% of the real bits of such a chunk of
held-out documentation text (the storage ladder's text, docs/connector.md "Storage cost") at
every level, coded and packed, and within 20% on held-out prose, where the tables fit worse
(measured at the default levels: 5 to 11% below the real bits on both shipped models).
"""

from __future__ import annotations

import numpy as np
import pytest

from cachegen.codec.tcq.size import estimated_bits, symbol_widths
from cachegen.modes import FORMS, PACKED

CHUNK = 256
TOLERANCE = {"eval": 0.10, "prose": 0.20}


@pytest.fixture(scope="module")
def held_out(request):
    """``held_out(model, text)``: (tcq codec, KV of a chunk of held-out ``text``)."""
    from cachegen import workload
    from cachegen.extract import extract_kv, load_model
    from cachegen.profiles import codec_for

    cache = {}

    def make(model: str, text: str):
        if (model, text) not in cache:
            spec = request.getfixturevalue(model)
            _, tokenizer, _ = load_model(spec)
            words = workload.text("eval") if text == "eval" else workload.domain_text(text)
            ids = tokenizer(words[: 12 * CHUNK])["input_ids"][:CHUNK]
            assert len(ids) == CHUNK
            cache[model, text] = (codec_for("tcq", spec), extract_kv(spec, token_ids=ids))
        return cache[model, text]

    return make


@pytest.mark.parametrize("text", list(TOLERANCE))
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_the_estimate_is_near_the_real_bits_of_held_out_kv(model, text, held_out):
    codec, kv = held_out(model, text)
    elements = 2 * kv.keys.numel()
    levels = codec.levels if text == "eval" else [codec.default_level]
    for level in levels:
        for form in FORMS:
            estimate = codec.estimated_bits(level, CHUNK, form)
            real = 8 * len(codec.encode(kv, level, form=form)) / elements
            assert estimate == pytest.approx(real, rel=TOLERANCE[text]), (level, form, real)


def test_the_estimate_is_the_model_files_alone(smollm2, held_out):
    codec, _ = held_out("smollm2", "eval")
    bits = [[estimated_bits(codec.tcq, lv, CHUNK, form) for form in FORMS] for lv in codec.levels]
    assert bits == [
        [codec.estimated_bits(lv, CHUNK, form) for form in FORMS] for lv in codec.levels
    ]
    coded, packed = np.array(bits).T
    assert np.all(np.diff(coded) > 0) and np.all(np.diff(packed) > 0)  # finer levels cost more
    assert np.all(packed > coded)  # the packed form is the larger one
    # the first token is stored exactly: a longer chunk spreads it over more tokens
    level = codec.default_level
    assert codec.estimated_bits(level, 2 * CHUNK) < codec.estimated_bits(level, CHUNK)
    assert codec.estimated_bits(level, CHUNK, PACKED) == bits[codec.levels.index(level)][1]


def test_a_components_width_spans_its_tables_likely_symbols():
    tables = np.array(
        [
            [1, 1, 1, 1018, 1, 1, 1],  # one symbol and the floor: every frame's symbols alike
            [1, 1, 200, 620, 200, 1, 1],  # three symbols: a range of 2, 2 bits
            [146, 146, 146, 148, 146, 146, 146],  # flat: the whole alphabet, 7 symbols
            [1, 1, 1, 1021, 0, 0, 0],  # an alphabet of 4 (zero past it)
        ]
    )
    assert symbol_widths(tables, 255).tolist() == [0, 2, 3, 0]
    # over few tokens the rarer symbols are unlikely to turn up
    assert symbol_widths(np.array([[1, 30, 100, 762, 100, 30, 1]]), 2).tolist() == [0]
    assert symbol_widths(np.array([[1, 30, 100, 762, 100, 30, 1]]), 255).tolist() == [3]
