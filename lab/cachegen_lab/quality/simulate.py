"""The codec's quantizer without its entropy coder, for fast what-if probes.

Calibration tries hundreds of (layer, K/V, bins) variants; running the full codec (tables,
rANS) for each would waste time on bytes nobody stores. :func:`quantize_kv` applies the
codec's own kernels (``cachegen.codec.cachegen.quant``) chunk by chunk exactly as the encoder does,
and :func:`estimated_bits` estimates what the entropy coder would spend: the empirical
entropy of each (layer, K/V, channel)'s symbols plus the fp16 scales and the exactly stored
tokens. Final numbers
always come from the real codec.
"""

from __future__ import annotations

import torch

from cachegen.codec.cachegen.quant import (
    QuantConfig,
    alphabet_size,
    dequantize,
    exact_count,
    quantize_chunk,
    reconstruct,
)
from cachegen.kv import KVCache

KINDS = ("k", "v")
SCALE_BITS = 16


def _tensor(kv: KVCache, kind: str) -> torch.Tensor:
    return (kv.keys if kind == "k" else kv.values).to(torch.float32)


def quantize_kind(
    kv: KVCache, config: QuantConfig, kind: str, chunk_tokens: int, *, count_bits: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reconstruction ``[L, H, T, D]`` (float32) and estimated bits per layer ``[L]`` (``None``
    without ``count_bits``) of the keys or values of ``kv``."""
    x = _tensor(kv, kind)
    out = torch.empty_like(x)
    L, H, T, D = x.shape
    bins = config.bins(kind)
    width = max(alphabet_size(b) for b in bins)
    # One distribution per (layer, segment, channel), as the codec's tables have.
    counts = torch.zeros(L, 2, H * D, width, dtype=torch.int64)
    row = (
        torch.arange(L).view(L, 1, 1) * 2 * H * D + torch.arange(H * D).view(1, H * D, 1)
    ) * width
    scale_bits = torch.zeros(L)
    for begin in range(0, T, chunk_tokens):
        chunk = x[:, :, begin : begin + chunk_tokens]
        decoded = torch.empty_like(chunk)
        for s, seg in enumerate(quantize_chunk(chunk, config, kind, kv.start + begin)):
            decoded[:, :, seg.tokens] = dequantize(seg.symbols, seg.scales, bins)
            if not count_bits:
                continue
            sym = seg.symbols.permute(0, 1, 3, 2).reshape(L, H * D, -1).to(torch.int64)
            index = (row + s * H * D * width + sym).reshape(-1)
            counts += torch.bincount(index, minlength=counts.numel()).view(counts.shape)
            scale_bits += SCALE_BITS * seg.scales[0].numel()
        out[:, :, begin : begin + chunk_tokens] = reconstruct(
            decoded, config, kind, kv.start + begin
        )
    exact = exact_count(config, kv.start, T)
    out[:, :, :exact] = x[:, :, :exact]
    if not count_bits:
        return out, None
    exact_bits = kv.dtype.itemsize * 8 * H * exact * D
    bits = (
        torch.tensor([_entropy_bits(counts[layer].view(-1, width)) for layer in range(L)])
        + scale_bits
        + exact_bits
    )
    return out, bits


def _entropy_bits(counts: torch.Tensor) -> float:
    """Total ideal code length of symbols with one empirical distribution per row."""
    total = counts.sum(dim=1, keepdim=True).clamp_min(1)
    p = counts / total
    return float(-(counts * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum())


def quantize_kv(
    kv: KVCache, config: QuantConfig, chunk_tokens: int, *, count_bits: bool = True
) -> tuple[KVCache, float]:
    """``kv`` after the codec's quantizer, in ``kv``'s dtype, and estimated bits in total
    (NaN without ``count_bits``)."""
    keys, kbits = quantize_kind(kv, config, "k", chunk_tokens, count_bits=count_bits)
    values, vbits = quantize_kind(kv, config, "v", chunk_tokens, count_bits=count_bits)
    decoded = KVCache(keys.to(kv.dtype), values.to(kv.dtype), kv.token_ids, kv.model, kv.start)
    return decoded, float(kbits.sum() + vbits.sum()) if count_bits else float("nan")
