"""Decode speed of the transform codecs, side by side with cachegen level 2 in one run, and
what tcq's per-frame choices cost its encoder (pytest-benchmark; skipped by
`--benchmark-skip`).

    .venv/bin/pytest benchmarks/micro/test_transform_codec_speed.py --benchmark-only

Data: the same SmolLM2 KV as ``test_codec_speed.py`` (1,024 tokens of Python documentation,
4 chunks of 256 tokens, 11.8 M elements), and for the ``gemma3-270m-`` cases Gemma 3's KV of
the same text (9.4 M elements): its default level, 23, and level 24 (its default before, which
the forced-arithmetic cases keep). Each case decodes one bitstream into a fresh bf16
tensor, as a server decodes a fetched chunk, on both cores. Target (docs/codec.md): every
``tcq`` level >= 300 M elements/s, recorded in ``extra_info`` with the bits per element
(timings on a shared machine are noisy, so nothing is asserted about them). The tcq levels
synthesize as this CPU does (``tcq_decode.synthesis_arithmetic``: a bfloat16 GEMM where the CPU
has AMX, else the int16 kernel where it was built and the CPU has AVX2, else a bfloat16 GEMM
where the CPU has AVX512-BF16, else float32); ``tcq-24-bf16``, ``tcq-24-int16``,
``tcq-24-int16-avx2`` (the kernel's AVX2 loops where the CPU also has the AVX512-VNNI ones) and
``tcq-24-float32`` force each synthesis beside them (skipped where the CPU cannot run it or it
is the CPU's own choice);
``tcq-<L>-packed`` decode the packed form (the same symbols bit-packed, no rANS pass);
``tcq-24-unrefined`` the default level's coded form without refined rows (what refining the
attention sinks' rows costs the decoder, docs/codec.md "Refined rows").
The encode cases code level 23 with and without the choices (the same model file, its table
family left out).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from cachegen.codec import decode, get_codec
from cachegen.codec.tcq import decode as tcq_decode
from cachegen.codec.tcq import int_synthesis
from cachegen.codec.tcq import model as tcq_model
from cachegen.modes import CODED, PACKED
from cachegen.profiles import codec_for
from cachegen_lab.bench.codec_report import text_windows
from tests.support import CHUNK

TOKENS = 1024
DECODE_TARGET = 300e6
INT16_AVX2 = f"{tcq_decode.INT16}-{int_synthesis.AVX2_LOOPS}"  # the int16 kernel's AVX2 loops
ARITHMETICS = (tcq_decode.BF16, tcq_decode.INT16, INT16_AVX2, tcq_decode.FLOAT32)


SMOLLM2, GEMMA3 = "smollm2-135m", "gemma3-270m"


@pytest.fixture(scope="module")
def windows():
    """One window of each model's KV, made when a case first asks for it."""
    made = {}

    def window(model: str):
        if model not in made:
            (made[model],) = text_windows(model, TOKENS, 1)
        return made[model]

    return window


@pytest.fixture(scope="module")
def kv(windows):
    return windows(SMOLLM2)


def _case(model, name, level, form=CODED, arithmetic=None, refine=True, suffix=""):
    tag = "" if model == SMOLLM2 else f"{GEMMA3}-"
    name_level = f"{name}-{level}{suffix}"
    return pytest.param(model, name, level, form, arithmetic, refine, id=f"{tag}{name_level}")


CASES = (
    [_case(SMOLLM2, "cachegen", 2)]
    + [_case(SMOLLM2, "tcq", lv) for lv in range(20, 27)]
    + [_case(SMOLLM2, "tcq", 24, arithmetic=a, suffix=f"-{a}") for a in ARITHMETICS]
    + [_case(SMOLLM2, "tcq", 24, refine=False, suffix="-unrefined")]
    + [_case(SMOLLM2, "tcq", lv, PACKED, suffix="-packed") for lv in (22, 24, 25)]
    + [_case(GEMMA3, "tcq", lv) for lv in (23, 24)]
    + [_case(GEMMA3, "tcq", 24, arithmetic=a, suffix=f"-{a}") for a in ARITHMETICS]
    + [_case(GEMMA3, "tcq", 24, refine=False, suffix="-unrefined")]
)


@pytest.mark.parametrize("model,name,level,form,arithmetic,refine", CASES)
def test_transform_decode(
    benchmark, windows, model, name, level, form, arithmetic, refine, monkeypatch
):
    """``arithmetic``: the synthesis forced (None: this CPU's choice); ``refine``: tcq's coded
    frames refine their sinks' rows (the default)."""
    kv = windows(model)
    if arithmetic is not None:
        _force(arithmetic, monkeypatch)
    options = {} if name != "tcq" else {"refine": refine}
    codec = codec_for(name, model, chunk_tokens=CHUNK, **options)
    if level not in codec.levels:
        pytest.fail(f"{name} has no level {level}: its levels are {codec.levels}")
    blob = codec.encode(kv, level, form)
    out = benchmark(decode, blob)
    assert out.keys.dtype == torch.bfloat16 and out.num_tokens == TOKENS
    benchmark.extra_info.update(
        {
            "elements": int(kv.num_elements),
            "what": f"{model} {name} level {level} ({form}) -> bf16, 2 thread(s)"
            + (f", {arithmetic} synthesis" if arithmetic else "")
            + ("" if refine else ", no refined rows"),
            "bits_per_element": len(blob) * 8 / kv.num_elements,
        }
    )
    if name == "tcq":
        benchmark.extra_info["target_elements_per_s"] = DECODE_TARGET
        benchmark.extra_info["int16_loops"] = (int_synthesis.loops_here() or (None,))[-1]
    stats = getattr(benchmark, "stats", None)
    if stats:
        for key, seconds in (("best", stats.stats.min), ("median", stats.stats.median)):
            benchmark.extra_info[f"m_elements_per_s_{key}"] = kv.num_elements / seconds / 1e6


def _force(arithmetic: str, monkeypatch) -> None:
    """Make the decoder synthesize in ``arithmetic``, or skip where this CPU cannot."""
    integer = arithmetic in (tcq_decode.INT16, INT16_AVX2)
    if integer and not int_synthesis.available():
        pytest.skip("the int16 kernel is not built here or the CPU has no AVX2")
    if arithmetic == INT16_AVX2 and int_synthesis.loops_here()[-1] == int_synthesis.AVX2_LOOPS:
        pytest.skip("the AVX2 loops are this CPU's int16 case already (it has no AVX512-VNNI)")
    if arithmetic == tcq_decode.BF16 and not tcq_decode.bf16_synthesis():
        pytest.skip("this CPU has no bfloat16 matrix instructions (AMX or AVX512-BF16)")
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: arithmetic == tcq_decode.BF16)
    monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda: integer)
    if arithmetic == INT16_AVX2:
        monkeypatch.setattr(int_synthesis, "loops_here", lambda: (int_synthesis.AVX2_LOOPS,))


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
