"""The ``tcq`` model's component weights: how much a unit of each component's quantization
error moves the attention output, from one calibration pass that samples the model's queries
and its residual stream's energy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cachegen import models
from cachegen.codec.tcq.code import EXACT_TOKENS
from cachegen.codec.transform.basis import TransformBasis
from cachegen.codec.transform.rotary import apply_rotary, rotary_cos_sin
from cachegen.fitting.kvtc import fit_kv
from cachegen.kv import KVCache


def decoder_layers(hf_model) -> list | None:
    """The model's decoder layers, if laid out like Llama/Qwen2/Gemma 3 (``self_attn`` with
    ``q_proj`` and ``o_proj``); None otherwise."""
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if layers is None or not all(
        hasattr(getattr(layer, "self_attn", None), name)
        for layer in layers
        for name in ("q_proj", "o_proj")
    ):
        return None
    return list(layers)


def _sandwich(layer) -> bool:
    """Gemma-style layers normalize the attention output before adding it to the residual."""
    return hasattr(layer, "pre_feedforward_layernorm")


@dataclass
class LayerStats:
    """What one layer's component weights need from the calibration pass."""

    queries: torch.Tensor  # [query heads, rows, head_dim] pre-RoPE queries of sampled tokens
    positions: torch.Tensor  # [rows] their positions
    scale: float  # mean squared norm of what the attention's error is relative to


def attention_stats(hf_model, spec: models.ModelSpec, ids: torch.Tensor, skip: int, rows: int):
    """``(kv, stats)``: the KV of ``ids`` and each layer's :class:`LayerStats` (None for a
    model whose layers are not recognised). ``rows`` tokens from ``skip`` on, evenly spaced,
    keep their queries. ``hf_model`` is :func:`~cachegen.fitting.kvtc.fit_model`'s, the one
    that :func:`~cachegen.fitting.kvtc.fit_kv` runs."""
    layers = decoder_layers(hf_model)
    if layers is None:
        return fit_kv(spec, ids), None
    n, D = len(ids), spec.identity().head_dim
    positions = torch.unique(torch.linspace(skip, n - 1, rows).round().to(torch.int64))
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def energy(x: torch.Tensor) -> torch.Tensor:
        return (x.detach().to(torch.float64)[0, skip:] ** 2).sum(dim=-1).mean()

    def sampled_queries(x: torch.Tensor) -> torch.Tensor:
        """[heads, rows, D] from q_proj's [1, n, heads * D] or q_norm's [1, heads, n, D]."""
        x = x.detach().float()[0]
        if x.dim() == 3:
            return x[:, positions]
        return x.reshape(n, -1, D)[positions].permute(1, 0, 2)

    def keep(i: int, what: str, fn):
        def hook(module, args, *rest):
            x = rest[-1] if what != "residual" else (args[0] if args else rest[0]["hidden_states"])
            captured[i, what] = fn(x)

        return hook

    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q_source = getattr(attn, "q_norm", None) or attn.q_proj
        handles.append(q_source.register_forward_hook(keep(i, "q", sampled_queries)))
        handles.append(
            layer.register_forward_pre_hook(keep(i, "residual", energy), with_kwargs=True)
        )
        if _sandwich(layer):
            handles.append(attn.o_proj.register_forward_hook(keep(i, "o", energy)))
            handles.append(
                layer.post_attention_layernorm.register_forward_hook(keep(i, "normed", energy))
            )
    try:
        kv = fit_kv(spec, ids)
    finally:
        for handle in handles:
            handle.remove()
    stats = []
    for i, layer in enumerate(layers):
        scale = float(captured[i, "residual"])
        if _sandwich(layer):  # an error relative to the attention output, then renormalized
            scale *= float(captured[i, "o"]) / float(captured[i, "normed"])
        stats.append(LayerStats(captured[i, "q"], positions, scale))
    return kv, stats


def attention_probabilities(
    queries: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, scaling: float, window
) -> torch.Tensor:
    """Attention of post-RoPE ``queries`` [rows, D] at ``positions`` over ``keys`` [n, D]."""
    scores = scaling * queries @ keys.T
    t = torch.arange(keys.shape[0])[None, :]
    hidden = t > positions[:, None]
    if window:
        hidden |= t <= positions[:, None] - window
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


def layer_weights(
    layer_module,
    stats: LayerStats,
    keys: torch.Tensor,
    values: torch.Tensor,
    theta: float,
    window,
    components: np.ndarray,
    exponent: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Key and value component weights [C] of one layer: the expected squared error each
    unit of a component's quantization error puts into the attention output (after the
    output projection, relative to ``stats.scale`` to the power ``exponent``), averaged over
    the sampled queries.

    A value error at token ``t`` reaches head ``h``'s output as ``a_t W_o^h dv``; a key error
    moves logit ``t`` by ``s q . dk`` and the output by ``a_t s (q . dk) W_o^h (v_t - o)``.
    Rotary angles mix the two channels of each pair (``d``, ``d + D/2``), so for the keys
    each channel takes its pair's mean query energy. Tokens stored exactly do not count."""
    attn = layer_module.self_attn
    kv_heads, n, D = keys.shape
    heads = stats.queries.shape[0]
    group = heads // kv_heads
    scaling = float(getattr(attn, "scaling", D**-0.5))
    o_proj = attn.o_proj.weight.detach().to(torch.float32)
    q_pre = stats.queries.float()
    q_post = q_pre
    if theta:
        cos, sin = rotary_cos_sin(0, n, D, theta)
        q_post = apply_rotary(q_pre, cos[stats.positions], sin[stats.positions])
    key_energy = torch.zeros(kv_heads, D, dtype=torch.float64)
    value_gram = torch.zeros(kv_heads, D, D, dtype=torch.float64)
    for h in range(heads):
        g = h // group
        w_h = o_proj[:, h * D : (h + 1) * D]
        gram = w_h.T @ w_h
        a = attention_probabilities(q_post[h], stats.positions, keys[g], scaling, window)
        a2 = a**2
        a2[:, :EXACT_TOKENS] = 0
        v = values[g]
        mixed = a @ v  # [rows, D]: the head's output before the projection
        v_gram = v @ gram
        spread = (v_gram * v).sum(-1)[None, :] - 2 * mixed @ v_gram.T
        spread += ((mixed @ gram) * mixed).sum(-1)[:, None]
        sensitivity = scaling**2 * (a2 * spread.clamp_min(0)).sum(-1)  # [rows]
        energy = (sensitivity[:, None] * q_pre[h] ** 2).mean(0).double()
        if theta:
            pair = (energy[: D // 2] + energy[D // 2 :]) / 2
            energy = torch.cat([pair, pair])
        key_energy[g] += energy
        value_gram[g] += a2.sum(-1).mean().double() * gram.double()
    u = components.reshape(2, -1, kv_heads, D)
    key_w = (u[0] ** 2).reshape(-1, kv_heads * D) @ key_energy.reshape(-1).numpy()
    value_w = np.einsum("igd,gde,ige->i", u[1], value_gram.numpy(), u[1])
    scale = stats.scale**exponent
    return key_w / scale, value_w / scale


def component_weights(
    hf_model, kv: KVCache, stats, basis: TransformBasis, exponent: float
) -> np.ndarray:
    """Weights [L, 2, C], scaled together so that their variance-weighted mean is 1 (all ones
    for a model whose layers are not recognised)."""
    L, _, C = basis.variances.shape
    if stats is None:
        return np.ones((L, 2, C), dtype=np.float32)
    layers = decoder_layers(hf_model)
    weights = np.zeros((L, 2, C), dtype=np.float64)
    windows = kv.windows or (None,) * L
    for layer in range(L):
        weights[layer] = layer_weights(
            layers[layer],
            stats[layer],
            kv.keys[layer].float(),
            kv.values[layer].float(),
            basis.rope_thetas[layer],
            windows[layer],
            basis.components[layer].astype(np.float64),
            exponent,
        )
    var = basis.variances.astype(np.float64)
    weights *= var.sum() / (weights * var).sum()
    return np.maximum(weights, 1e-12).astype(np.float32)
