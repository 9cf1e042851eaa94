"""The packed-form bits that chose the default levels: the codec's estimate (from the bins)
and the bytes it writes agree; the ranking keeps what fits first."""

from __future__ import annotations

import torch

from cachegen.codec import QuantConfig, get_codec
from cachegen.codec.cachegen.size import packed_bits
from cachegen_lab.experiments.packed_fit import rank
from tests.support import CHUNK


def test_packed_bits_match_what_the_codec_writes(tiny_llama, isolated_profiles):
    from cachegen.extract import extract_kv
    from cachegen.profiles import transient_profile

    ident = tiny_llama.identity()
    L = ident.num_layers
    config = QuantConfig((32,) * L, (8,) * L, "token", "token-head", hadamard=True, exact_tokens=1)
    codec = get_codec("cachegen", profile=transient_profile(tiny_llama, {5: config}))
    estimate = packed_bits(config, ident.num_kv_heads, ident.head_dim, CHUNK)
    assert estimate == codec.estimated_bits(5, CHUNK, "packed")
    kv = extract_kv(tiny_llama, token_ids=torch.arange(3, 3 + CHUNK))
    blob = codec.encode(kv, level=5, form="packed")
    measured = 8 * len(blob) / kv.num_elements
    # 5 + 3 bits of symbols, scales and the exact token; the header and token ids add the rest
    assert estimate < measured < estimate + 0.5


def test_rank_puts_what_fits_first_by_perplexity_or_kl(tiny_llama):
    def trial(bins: int, ppl: float, kl: float) -> dict:
        L = tiny_llama.identity().num_layers
        config = QuantConfig((bins,) * L, (bins,) * L).to_dict()
        return {"config": config, "est_bits_per_element": 2.0, "ppl_change_pct": ppl, "kl": kl}

    document = {
        "model": {"name": tiny_llama.name},
        "trials": [trial(64, 0.1, 0.01), trial(16, 2.0, 0.02), trial(32, 1.0, 0.05)],
    }
    rows = rank(document, budget=7.5)
    assert [r["fits"] for r in rows] == [True, True, False]  # 64 bins: 6 bits + 2 coded > 7.5
    assert [r["ppl_change_pct"] for r in rows] == [1.0, 2.0, 0.1]
    assert [r["kl"] for r in rank(document, budget=7.5, by="kl")] == [0.02, 0.05, 0.01]
