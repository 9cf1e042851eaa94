"""Decode speed of the transform codecs, side by side with cachegen level 2 in one run, and
what tcq's per-frame choices cost its encoder (pytest-benchmark; skipped by
`--benchmark-skip`).

    .venv/bin/pytest benchmarks/micro/test_transform_codec_speed.py --benchmark-only

Data: the same SmolLM2 KV as ``test_codec_speed.py`` (1,024 tokens of Python documentation,
4 chunks of 256 tokens, 11.8 M elements). Each case decodes one bitstream into a fresh bf16
tensor, as a server decodes a fetched chunk, on both cores. Target (docs/codec.md): every
``tcq`` level >= 300 M elements/s, recorded in ``extra_info`` with the bits per element
(timings on a shared machine are noisy, so nothing is asserted about them). The tcq levels
synthesize as this CPU does (``tcq_decode.synthesis_arithmetic``: a bfloat16 GEMM where the CPU
has bfloat16 matrix instructions, else the int16 kernel where it was built and the CPU has
AVX2, else float32); ``tcq-24-f32`` and ``tcq-24-int16`` force the float32 and the int16
synthesis beside them;
``tcq-<L>-packed`` decode the packed form (the same symbols bit-packed, no rANS pass).
The encode cases code level 23 with and without the choices (the same model file, its table
family left out).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cachegen.codec import decode, get_codec, int_synthesis, tcq_decode, tcq_model
from cachegen.lab.bench.codec_report import text_windows
from cachegen.modes import CODED, PACKED
from cachegen.profiles import codec_for
from tests.support import CHUNK

TOKENS = 1024
DECODE_TARGET = 300e6


@pytest.fixture(scope="module")
def kv():
    (window,) = text_windows("smollm2-135m", TOKENS, 1)
    return window


CASES = (
    [pytest.param("cachegen", 2, CODED, None, id="cachegen-2")]
    + [pytest.param("tcq", level, CODED, None, id=f"tcq-{level}") for level in range(20, 27)]
    + [pytest.param("tcq", 24, CODED, tcq_decode.FLOAT32, id="tcq-24-f32")]
    + [pytest.param("tcq", 24, CODED, tcq_decode.INT16, id="tcq-24-int16")]
    + [pytest.param("tcq", lv, PACKED, None, id=f"tcq-{lv}-packed") for lv in (22, 24, 25)]
)


@pytest.mark.parametrize("name,level,form,arithmetic", CASES)
def test_transform_decode(benchmark, kv, name, level, form, arithmetic, monkeypatch):
    """``arithmetic``: the synthesis forced (None: this CPU's choice)."""
    if arithmetic is not None:
        if arithmetic == tcq_decode.INT16 and not int_synthesis.available():
            pytest.skip("the int16 kernel is not built here or the CPU has no AVX2")
        monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: False)
        monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda: arithmetic == "int16")
    codec = codec_for(name, "smollm2-135m", chunk_tokens=CHUNK)
    if level not in codec.levels:
        pytest.fail(f"{name} has no level {level}: its levels are {codec.levels}")
    blob = codec.encode(kv, level, form)
    out = benchmark(decode, blob)
    assert out.keys.dtype == torch.bfloat16 and out.num_tokens == TOKENS
    benchmark.extra_info.update(
        {
            "elements": int(kv.num_elements),
            "what": f"{name} level {level} ({form}) -> bf16, 2 thread(s)"
            + (f", {arithmetic} synthesis" if arithmetic else ""),
            "bits_per_element": len(blob) * 8 / kv.num_elements,
        }
    )
    if name == "tcq":
        benchmark.extra_info["target_elements_per_s"] = DECODE_TARGET
    stats = getattr(benchmark, "stats", None)
    if stats:
        for key, seconds in (("best", stats.stats.min), ("median", stats.stats.median)):
            benchmark.extra_info[f"m_elements_per_s_{key}"] = kv.num_elements / seconds / 1e6


@pytest.mark.parametrize("choices", [True, False], ids=["tcq-23", "tcq-23-without-choices"])
def test_transform_encode(benchmark, kv, choices):
    model = codec_for("tcq", "smollm2-135m").tcq
    if not choices:
        static = np.zeros((0, tcq_model.MAX_RADIUS + 1), np.uint32)
        model = dataclasses.replace(model, family=static)
    codec = get_codec("tcq", tcq=model, chunk_tokens=CHUNK)
    blob = benchmark(codec.encode, kv, 23)
    benchmark.extra_info.update(
        {
            "elements": int(kv.num_elements),
            "what": "tcq level 23 from bf16, 2 thread(s)"
            + ("" if choices else ", without per-frame choices"),
            "bits_per_element": len(blob) * 8 / kv.num_elements,
        }
    )
    stats = getattr(benchmark, "stats", None)
    if stats:
        benchmark.extra_info["m_elements_per_s_median"] = kv.num_elements / stats.stats.median / 1e6
