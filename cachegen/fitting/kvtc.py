"""The model's KVTC basis: per-layer PCA bases (keys turned back to pre-RoPE) and each
level's bit allocation, fitted on the workload's ``calibrate`` split."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from cachegen import models, workload
from cachegen.codec.cachegen.profile import locked, profile_path
from cachegen.codec.transform import kvtc_basis
from cachegen.codec.transform.basis import (
    TransformBasis,
    allocate_bits,
    find_basis,
    fit_pca,
    save_basis,
)
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.kv import KVCache

KVTC_CALIBRATION_SPLIT = "calibrate"
KVTC_CALIBRATION_TOKENS = 4096
# Fits run the model in float32 on every CPU: its bf16 kernels round differently on each CPU
# kind (AMX, AVX512-BF16, emulated), and what a fit measures through the model (the
# sensitivities' KL above all) would follow that rounding.
FIT_MODEL_DTYPE = torch.float32


def fit_model(spec: models.ModelSpec):
    """``(hf_model, tokenizer, spec)`` as fits run the model: in float32."""
    from cachegen.extract import load_model

    return load_model(spec, FIT_MODEL_DTYPE)


def fit_kv(spec: models.ModelSpec, ids: torch.Tensor) -> KVCache:
    """The KV of ``ids`` as fits see it: the model run in float32 (:func:`fit_model`'s, whose
    hooks see the run), the KV rounded to bf16 as the codecs are given it."""
    from cachegen.extract import extract_kv

    return extract_kv(spec, token_ids=ids, dtype=FIT_MODEL_DTYPE).to(torch.bfloat16)


def kvtc_calibration_spec() -> dict:
    """What a KVTC basis is fitted on; recorded in the basis and its reference."""
    return {
        "source": "pydoc_data.topics",
        "split": KVTC_CALIBRATION_SPLIT,
        "text_sha256": hashlib.sha256(workload.text(KVTC_CALIBRATION_SPLIT).encode()).hexdigest(),
        "max_tokens": KVTC_CALIBRATION_TOKENS,
        "skip_tokens": kvtc_basis.EXACT_TOKENS,
        "keys": "pre-RoPE",
        "levels": {str(k): v for k, v in kvtc_basis.LEVELS.items()},
    }


def calibration_ids(tokenizer, spec: models.ModelSpec) -> torch.Tensor:
    """The token ids of the calibration text the model file fits run on."""
    ids = tokenizer(workload.text(KVTC_CALIBRATION_SPLIT))["input_ids"][:KVTC_CALIBRATION_TOKENS]
    return torch.tensor(ids, dtype=torch.int64)[: spec.max_positions]


def pre_rope_kv(kv: KVCache, thetas, skip: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (turned back to pre-RoPE by the rotary bases ``thetas``) and values of ``kv``
    from token ``skip`` on, float32 [L, H, n, D]."""
    keys = kv.keys[:, :, skip:].to(torch.float32)
    if any(thetas):
        keys = rotate_layer_keys(keys, skip, thetas, inverse=True)
    return keys, kv.values[:, :, skip:].to(torch.float32)


def fit_kvtc_basis(spec: models.ModelSpec, kv: KVCache | None = None) -> TransformBasis:
    """Fit the per-layer PCA bases (keys turned back to pre-RoPE) and every level's bit
    allocation on the ``calibrate`` split's KV; the first ``kvtc_basis.EXACT_TOKENS`` tokens, stored
    exactly by the codec, are left out of the fit. ``kv``: that KV (:func:`fit_kv` of
    :func:`calibration_ids`), where the caller has already run the model over it."""
    _, tokenizer, spec = fit_model(spec)
    if kv is None:
        kv = fit_kv(spec, calibration_ids(tokenizer, spec))
    thetas = models.rope_thetas(spec.config)
    keys, values = pre_rope_kv(kv, thetas, kvtc_basis.EXACT_TOKENS)
    L, H, n, D = keys.shape
    fits = [
        [
            fit_pca(x[layer].permute(1, 0, 2).reshape(n, H * D).double().numpy())
            for x in (keys, values)
        ]
        for layer in range(L)
    ]
    mean, components, variances = (
        np.array([[f[i] for f in layer_fits] for layer_fits in fits], dtype=np.float32)
        for i in range(3)
    )
    bits = np.array(
        [
            [
                [allocate_bits(v, round(budget * H * D)) for v in layer_vars]
                for layer_vars in variances
            ]
            for budget in kvtc_basis.LEVELS.values()
        ],
        dtype=np.uint8,
    )
    return TransformBasis(
        spec.identity(),
        kvtc_calibration_spec(),
        tuple(thetas),
        dict(kvtc_basis.LEVELS),
        mean,
        components,
        variances,
        bits,
    )


def ensure_kvtc_basis(
    model: str | models.ModelSpec, calibration_kv: KVCache | None = None
) -> TransformBasis:
    """The model's KVTC basis, fitted and stored on first use (or when it was fitted on other
    text); a stored basis is read and checked like any. ``calibration_kv``: the calibration
    KV, if the caller has it (:func:`fit_kvtc_basis`)."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    with locked(profile_path(identity).parent):
        ref = kvtc_basis.read_kvtc_basis_ref(identity)
        if ref is not None and ref["calibration"] == kvtc_calibration_spec():
            return find_basis(ref["basis"], identity)
        basis = save_basis(fit_kvtc_basis(spec, calibration_kv))
        kvtc_basis.write_kvtc_basis_ref(basis)
        return basis
