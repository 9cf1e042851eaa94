"""Codec speed, side by side in one run (pytest-benchmark; skipped by `--benchmark-skip`).

    .venv/bin/pytest benchmarks/micro/test_codec_speed.py --benchmark-only \
        --benchmark-json=speed.json
    cachegen codec-report --skip-sizes --benchmark-json speed.json --write docs/codec.md

Data: SmolLM2 KV of 1,024 tokens of Python documentation text (4 chunks of 256 tokens,
11.8 M elements), the first window of ``cachegen codec-report``. Targets (docs/codec.md,
2-core machine, both cores): cachegen decode (entropy decode + dequantize to bf16) >= 300 M
elements/s, the packed form's decode >= 1,000 M elements/s, encode >= 150 M elements/s,
coded payload <= 1% above the ideal code length under the tables used. The size target is
asserted (it is deterministic); speeds are recorded in ``extra_info`` with their target,
because other jobs on a shared machine make timings noisy. Sizes come from the codec
report's ``measure`` and ``coder_overhead``.

Beside cachegen's default level, ``test_default_level_*`` time tcq's default level and the
peer codecs (``cachegen_lab.codecs.PEER_CODECS``: LMCache's CacheGen, fp8 and asymmetric
K16/V8 serdes, run through LMCache's own code, one frame per LMCache chunk) on the same KV,
both cores for our threads and torch's.

The bare entropy coders (ours, constriction, torchac, zstd) all code the same symbols: the
level-2 quantized KV, one probability model per (layer, K/V, channel) from the profile.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from cachegen.codec import decode, get_codec
from cachegen.codec.cachegen.encode import encode_chunk
from cachegen.codec.cachegen.quant import quantize_chunk
from cachegen.codec.coding import rans
from cachegen.profiles import codec_for, ensure_profile
from cachegen_lab.bench.codec_report import coder_overhead, measure, text_windows
from cachegen_lab.codecs import PEER_CODECS
from tests.support import CHUNK

TOKENS = 1024
LEVEL = 2
DECODE_TARGET = 300e6
PACKED_DECODE_TARGET = 1000e6
ENCODE_TARGET = 150e6


@pytest.fixture(scope="module")
def kv():
    (window,) = text_windows("smollm2-135m", TOKENS, 1)
    return window


@pytest.fixture(scope="module")
def profile():
    return ensure_profile("smollm2-135m")


@pytest.fixture(scope="module")
def symbols(kv, profile):
    """Level-2 symbols per (layer, K/V): [L, 2, C, TOKENS] uint8, and the table row of each
    channel."""
    tables = profile.tables(LEVEL)
    L, C = kv.num_layers, tables.num_channels
    out = np.empty((L, 2, C, TOKENS), dtype=np.uint8)
    for k, x in enumerate((kv.keys, kv.values)):
        for begin in range(0, TOKENS, CHUNK):
            (seg,) = quantize_chunk(x[:, :, begin : begin + CHUNK].float(), tables.config, "kv"[k])
            out[:, k, :, begin : begin + CHUNK] = (
                seg.symbols.permute(0, 1, 3, 2).reshape(L, C, -1).numpy()
            )
    rows = np.array(
        [[tables.base(layer, k, 0) + np.arange(C) for k in range(2)] for layer in range(L)]
    )
    return out, rows, tables


def _record(benchmark, elements, what, target=None):
    benchmark.extra_info.update({"elements": int(elements), "what": what})
    if target:
        benchmark.extra_info["target_elements_per_s"] = target


def _record_rate(benchmark, elements):
    """M elements/s of the fastest and the median round (absent when timing is off)."""
    stats = getattr(benchmark, "stats", None)
    if stats:
        benchmark.extra_info["m_elements_per_s_best"] = elements / stats.stats.min / 1e6
        benchmark.extra_info["m_elements_per_s_median"] = elements / stats.stats.median / 1e6


def _record_size(benchmark, codec, level, kv):
    """Bits per element and ratios of the KV, one bitstream per chunk as the store holds it."""
    sizes = measure(codec, level, [kv], CHUNK)
    benchmark.extra_info.update({k: sizes[k] for k in ("bits_per_element", "ratio_vs_int8")})


# ---- the codecs, end to end -----------------------------------------------------------------


@pytest.mark.parametrize("threads", ["1", "2"])
def test_cachegen_decode(benchmark, kv, profile, threads, monkeypatch):
    monkeypatch.setenv("CACHEGEN_CODEC_THREADS", threads)
    codec = codec_for("cachegen", "smollm2-135m", chunk_tokens=CHUNK)
    blob = codec.encode(kv, LEVEL)
    benchmark.group = "codec decode"
    out = benchmark(decode, blob)
    assert out.keys.dtype == torch.bfloat16
    _record(
        benchmark,
        kv.num_elements,
        f"cachegen level {LEVEL} -> bf16, {threads} thread(s)",
        DECODE_TARGET,
    )


def test_cachegen_decode_default_level(benchmark, kv, profile):
    """The level the connector uses unless told otherwise (calibrated: Hadamard, 32/12 bins)."""
    codec = codec_for("cachegen", "smollm2-135m", chunk_tokens=CHUNK)
    blob = codec.encode(kv)
    benchmark.group = "codec decode"
    benchmark(decode, blob)
    _record(
        benchmark,
        kv.num_elements,
        f"cachegen default level {codec.default_level} -> bf16, 2 thread(s)",
        DECODE_TARGET,
    )


def _form_level(codec, level):
    """A level of ``test_decode_by_form``: a number, the default level, or "rotary" (the
    first calibrated level that turns keys by their rotary angles without a Hadamard
    rotation: the kind the default level may become)."""
    if level == "default":
        return codec.default_level
    if level == "rotary":
        profile = codec.profile
        return min(
            lv
            for lv in codec.levels
            if profile.config(lv).derotates and not profile.config(lv).hadamard
        )
    return level


@pytest.mark.parametrize(
    "form,level",
    [
        ("int8", None),
        ("coded", LEVEL),
        ("packed", LEVEL),
        ("coded", "rotary"),
        ("packed", "rotary"),
        ("coded", "default"),
        ("packed", "default"),
    ],
)
def test_decode_by_form(benchmark, kv, profile, form, level):
    """A level's two forms side by side with int8, same KV, both cores, each the same call
    (``decode(blob)`` into a fresh bf16 tensor, as a server decodes a fetched chunk): the
    packed form must decode to the coded form's KV bit for bit (asserted) at >= 1,000 M
    elements/s (recorded)."""
    codec = codec_for("cachegen", "smollm2-135m", chunk_tokens=CHUNK)
    level = _form_level(codec, level)
    if form == "int8":
        blob = get_codec("int8", chunk_tokens=CHUNK).encode(kv)
    else:
        blob = codec.encode(kv, level, form=form)
        coded = decode(codec.encode(kv, level))
        packed = decode(codec.encode(kv, level, form="packed"))
        assert torch.equal(coded.keys.view(torch.int16), packed.keys.view(torch.int16))
        assert torch.equal(coded.values.view(torch.int16), packed.values.view(torch.int16))
    benchmark.group = "codec decode by form"
    benchmark(decode, blob)
    what = "int8 -> bf16" if form == "int8" else f"cachegen level {level} {form} -> bf16"
    target = PACKED_DECODE_TARGET if form == "packed" else None
    _record(benchmark, kv.num_elements, f"{what}, 2 thread(s)", target)
    benchmark.extra_info["bits_per_element"] = len(blob) * 8 / kv.num_elements
    _record_rate(benchmark, kv.num_elements)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_cachegen_encode(benchmark, kv, profile, threads, monkeypatch):
    monkeypatch.setenv("CACHEGEN_CODEC_THREADS", threads)
    codec = codec_for("cachegen", "smollm2-135m", chunk_tokens=CHUNK)
    benchmark.group = "codec encode"
    benchmark(codec.encode, kv, LEVEL)
    _record(
        benchmark,
        kv.num_elements,
        f"cachegen level {LEVEL} from bf16, {threads} thread(s)",
        ENCODE_TARGET,
    )
    _record_size(benchmark, codec, LEVEL, kv)


def test_cachegen_encode_default_level(benchmark, kv, profile):
    codec = codec_for("cachegen", "smollm2-135m", chunk_tokens=CHUNK)
    benchmark.group = "codec encode"
    benchmark(codec.encode, kv)
    _record(
        benchmark,
        kv.num_elements,
        f"cachegen default level {codec.default_level} from bf16, 2 thread(s)",
        ENCODE_TARGET,
    )
    _record_size(benchmark, codec, codec.default_level, kv)


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int8-zstd", "kivi2"])
def test_baseline_decode(benchmark, kv, name):
    blob = get_codec(name, chunk_tokens=CHUNK).encode(kv)
    benchmark.group = "codec decode"
    benchmark(decode, blob)
    _record(benchmark, kv.num_elements, f"{name} -> bf16")


@pytest.mark.parametrize("name", ["raw", "int8", "fp8", "int8-zstd", "kivi2"])
def test_baseline_encode(benchmark, kv, name):
    codec = get_codec(name, chunk_tokens=CHUNK)
    benchmark.group = "codec encode"
    benchmark(codec.encode, kv)
    _record(benchmark, kv.num_elements, f"{name} from bf16")
    _record_size(benchmark, codec, 0, kv)


# ---- tcq and the peers at their defaults, beside cachegen's default level ---------------------

DEFAULT_LEVEL_CODECS = ("tcq", *PEER_CODECS)


@pytest.fixture
def two_threads(monkeypatch):
    """Both cores, for our codecs' threads and for torch's (LMCache's serdes are torch ops)."""
    monkeypatch.setenv("CACHEGEN_CODEC_THREADS", "2")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _default_codec(name):
    """tcq with SmolLM2's model file; a peer at LMCache's chunk (CHUNK tokens)."""
    return codec_for(name, "smollm2-135m", chunk_tokens=CHUNK)


def _default_what(name, codec) -> str:
    if name in PEER_CODECS:
        return f"{name} (LMCache's own code)"
    return f"{name} default level {codec.default_level}"


@pytest.mark.parametrize("name", DEFAULT_LEVEL_CODECS)
def test_default_level_decode(benchmark, kv, name, two_threads):
    codec = _default_codec(name)
    blob = codec.encode(kv)
    benchmark.group = "codec decode"
    out = benchmark(decode, blob)
    assert out.keys.dtype == torch.bfloat16
    _record(benchmark, kv.num_elements, f"{_default_what(name, codec)} -> bf16, 2 thread(s)")
    benchmark.extra_info["bits_per_element"] = len(blob) * 8 / kv.num_elements


@pytest.mark.parametrize("name", DEFAULT_LEVEL_CODECS)
def test_default_level_encode(benchmark, kv, name, two_threads):
    codec = _default_codec(name)
    benchmark.group = "codec encode"
    benchmark(codec.encode, kv)
    _record(benchmark, kv.num_elements, f"{_default_what(name, codec)} from bf16, 2 thread(s)")
    _record_size(benchmark, codec, codec.default_level, kv)


def test_coded_size_is_within_one_percent_of_ideal(benchmark, kv, profile):
    """Payload of the rANS streams vs the ideal code length under the same tables (timed:
    coding one chunk)."""
    benchmark.group = "coded size"
    benchmark(encode_chunk, kv.slice(0, CHUNK), profile.tables(LEVEL))
    overhead = coder_overhead(profile, LEVEL, [kv], CHUNK)
    benchmark.extra_info.update(overhead)
    assert overhead["overhead_percent"] <= 1.0


# ---- bare entropy coders on the same symbols ------------------------------------------------


def _rans_inputs(sym, rows):
    """Our kernel's inputs: one stream per (layer, K/V) over all TOKENS tokens."""
    L, _, C, T = sym.shape
    sym4 = np.ascontiguousarray(
        sym.reshape(L * 2, C // 64, 64, T).transpose(0, 1, 3, 2)
    )  # [streams, H, T, D]
    n = L * 2
    base = rows[:, :, 0].reshape(-1).astype(np.int64)
    cap = C * T + rans.STATE_WORDS
    off = np.arange(n + 1, dtype=np.int64) * cap
    return (
        sym4,
        base,
        off,
        np.empty(off[-1], dtype=np.uint16),
        np.empty(n, dtype=np.int64),
        np.arange(n, dtype=np.int64),
    )


def test_coder_ours_encode(benchmark, symbols):
    sym, rows, tables = symbols
    sym4, base, off, out, start, todo = _rans_inputs(sym, rows)
    benchmark.group = "entropy coder encode (1 thread)"
    benchmark(rans.encode_layers, sym4, base, tables.freq_cum, out, off, todo, start)
    benchmark.extra_info["bits_per_symbol"] = float((off[1:] - start).sum() * 16 / sym.size)
    _record(benchmark, sym.size, "rANS (this repo), per-channel tables, symbols only")


def test_coder_ours_decode(benchmark, symbols):
    sym, rows, tables = symbols
    sym4, base, off, out, start, todo = _rans_inputs(sym, rows)
    rans.encode_layers(sym4, base, tables.freq_cum, out, off, todo, start)
    n = len(todo)
    words = np.concatenate([out[start[i] : off[i + 1]] for i in range(n)])
    word_off = np.concatenate([[0], np.cumsum(off[1:] - start)]).astype(np.int64)
    C = sym.shape[2]
    nch, ntok = np.full(n, C, dtype=np.int64), np.full(n, TOKENS, dtype=np.int64)
    zeros = np.zeros(n, dtype=np.int64)
    result = np.empty(sym.size, dtype=np.uint16)
    status = np.zeros(n, dtype=np.uint8)
    args = (
        words,
        word_off,
        nch,
        ntok,
        base,
        tables.slots,
        tables.freq_cum,
        (
            np.ones(1, dtype=np.float32),
            zeros,
            np.zeros((n, 3), np.int64),
            np.zeros(n, np.int32),
            64,
            np.arange(TOKENS, dtype=np.int64),
            zeros,
            np.empty(0, np.float32),
            result,
            np.arange(n, dtype=np.int64) * C * TOKENS,
            TOKENS,
        ),
        todo,
        status,
    )
    benchmark.group = "entropy coder decode (1 thread)"
    benchmark(rans.decode_streams, *args)
    assert not status.any()
    _record(
        benchmark, sym.size, "rANS (this repo), per-channel tables, symbols + dequantize to bf16"
    )


def _constriction_models(tables, rows):
    import constriction  # its submodules are attributes of a native module, not importable by path

    Categorical = constriction.stream.model.Categorical
    probs = tables.freq.astype(np.float64) / rans.PROB_SCALE
    return {int(r): Categorical(probs[r][probs[r] > 0], perfect=False) for r in rows.reshape(-1)}


def test_coder_constriction_encode(benchmark, symbols):
    import constriction

    AnsCoder = constriction.stream.stack.AnsCoder
    sym, rows, tables = symbols
    models = _constriction_models(tables, rows)
    seqs = [
        (models[int(r)], sym[i, k, c].astype(np.int32))
        for i in range(sym.shape[0])
        for k in range(2)
        for c, r in enumerate(rows[i, k])
    ]

    def run():
        coder = AnsCoder()
        for model, s in reversed(seqs):
            coder.encode_reverse(s, model)
        return coder.get_compressed()

    benchmark.group = "entropy coder encode (1 thread)"
    data = benchmark.pedantic(run, rounds=3, iterations=1)
    benchmark.extra_info["bits_per_symbol"] = float(data.size * 32 / sym.size)
    _record(benchmark, sym.size, "constriction ANS, one categorical model per channel")


def test_coder_constriction_decode(benchmark, symbols):
    import constriction

    AnsCoder = constriction.stream.stack.AnsCoder
    sym, rows, tables = symbols
    models = _constriction_models(tables, rows)
    seqs = [
        (models[int(r)], sym[i, k, c].astype(np.int32))
        for i in range(sym.shape[0])
        for k in range(2)
        for c, r in enumerate(rows[i, k])
    ]
    coder = AnsCoder()
    for model, s in reversed(seqs):
        coder.encode_reverse(s, model)
    data = coder.get_compressed()

    def run():
        dec = AnsCoder(data)
        return [dec.decode(model, TOKENS) for model, _ in seqs]

    benchmark.group = "entropy coder decode (1 thread)"
    out = benchmark.pedantic(run, rounds=3, iterations=1)
    assert np.array_equal(out[5], seqs[5][1])
    _record(benchmark, sym.size, "constriction ANS, one categorical model per channel")


TORCHAC_LAYERS = 2  # torchac needs a CDF per symbol: a subset keeps memory reasonable


def _torchac_inputs(symbols):
    sym, rows, tables = symbols
    sub = sym[:TORCHAC_LAYERS]  # [l, 2, C, T]
    r = rows[:TORCHAC_LAYERS]
    cum = (
        np.concatenate(
            [np.zeros((tables.freq.shape[0], 1)), np.cumsum(tables.freq, axis=1)], axis=1
        )
        / rans.PROB_SCALE
    )
    cdf = torch.from_numpy(cum[np.repeat(r.reshape(-1), TOKENS)].astype(np.float32))
    return cdf, torch.from_numpy(sub.reshape(-1).astype(np.int16))


def test_coder_torchac_encode(benchmark, symbols):
    torchac = pytest.importorskip(
        "torchac", reason="pip install torchac (it compiles a C++ extension on first import)"
    )
    cdf, s = _torchac_inputs(symbols)
    benchmark.group = "entropy coder encode (1 thread)"
    data = benchmark.pedantic(torchac.encode_float_cdf, args=(cdf, s), rounds=3, iterations=1)
    benchmark.extra_info["bits_per_symbol"] = len(data) * 8 / s.numel()
    _record(
        benchmark,
        s.numel(),
        f"torchac (original CacheGen's coder), CDF per symbol, {TORCHAC_LAYERS} layers",
    )


def test_coder_torchac_decode(benchmark, symbols):
    torchac = pytest.importorskip(
        "torchac", reason="pip install torchac (it compiles a C++ extension on first import)"
    )
    cdf, s = _torchac_inputs(symbols)
    data = torchac.encode_float_cdf(cdf, s)
    benchmark.group = "entropy coder decode (1 thread)"
    out = benchmark.pedantic(torchac.decode_float_cdf, args=(cdf, data), rounds=3, iterations=1)
    assert torch.equal(out, s)
    _record(
        benchmark,
        s.numel(),
        f"torchac (original CacheGen's coder), CDF per symbol, {TORCHAC_LAYERS} layers",
    )


def test_coder_zstd_encode(benchmark, symbols):
    import zstandard

    sym = np.ascontiguousarray(symbols[0]).tobytes()
    benchmark.group = "entropy coder encode (1 thread)"
    out = benchmark(zstandard.ZstdCompressor(level=3).compress, sym)
    benchmark.extra_info["bits_per_symbol"] = len(out) * 8 / len(sym)
    _record(benchmark, len(sym), "zstd level 3 on the symbol bytes (no model)")


def test_coder_zstd_decode(benchmark, symbols):
    import zstandard

    sym = np.ascontiguousarray(symbols[0]).tobytes()
    data = zstandard.ZstdCompressor(level=3).compress(sym)
    benchmark.group = "entropy coder decode (1 thread)"
    benchmark(zstandard.ZstdDecompressor().decompress, data)
    _record(benchmark, len(sym), "zstd level 3 on the symbol bytes (no model)")


@pytest.fixture(autouse=True)
def _one_torch_thread_for_bare_coders(request):
    """Bare coders are measured on one thread; the codec tests use the codec's own threads."""
    if request.node.name.startswith("test_coder_"):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)
    else:
        yield


def test_threads_setting_is_read(monkeypatch):
    from cachegen.codec.coding.parallel import num_threads

    monkeypatch.setenv("CACHEGEN_CODEC_THREADS", "1")
    assert num_threads() == 1
    monkeypatch.delenv("CACHEGEN_CODEC_THREADS")
    assert num_threads() == len(os.sched_getaffinity(0))
