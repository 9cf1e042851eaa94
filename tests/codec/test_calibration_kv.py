"""A tcq fit runs the model over the calibration text once: the KV its component weights are
measured on (``attention_stats``, which hooks that run) is the KV that the kvtc basis is fitted
on, so a tcq fit without a stored basis fits the basis from it."""

from __future__ import annotations

import torch

from cachegen.codec.transform import kvtc_basis
from cachegen.fitting.attention import attention_stats
from cachegen.fitting.kvtc import calibration_ids, fit_kv, fit_kvtc_basis, fit_model
from cachegen.fitting.tcq import TCQ_QUERY_ROWS


def test_the_weights_run_gives_the_calibration_kv_and_so_the_basis(tiny_llama):
    hf_model, tokenizer, spec = fit_model(tiny_llama)
    ids = calibration_ids(tokenizer, spec)
    kv, stats = attention_stats(hf_model, spec, ids, kvtc_basis.EXACT_TOKENS, TCQ_QUERY_ROWS)
    assert stats is not None  # tiny-llama's layers are recognised: the run was hooked
    alone = fit_kv(spec, ids)
    assert torch.equal(kv.keys, alone.keys) and torch.equal(kv.values, alone.values)
    assert fit_kvtc_basis(spec, kv).file_bytes == fit_kvtc_basis(spec).file_bytes
