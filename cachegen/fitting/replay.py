"""Run a model on new tokens with given KV caches as the past.

Quality evaluation asks "what does the model do when the context's KV is the decoded one
instead of the original?". This module turns :class:`~cachegen.kv.KVCache` objects
(post-RoPE keys, logical layout ``[layers, kv_heads, tokens, head_dim]``) into one batched
transformers ``DynamicCache`` and continues from it: teacher-forced logits for scoring and
greedy generation for answer-level metrics.

Several pasts can go through as rows of one batch, each computed independently of its
neighbours' values, but not of the batch's size: on CPUs with AMX, oneDNN's bf16 kernels
block and round differently for each shape, so the evaluation replays every KV alone
(``cachegen_lab.quality.evaluate``). The tests check that raw KV gives the logits of
recomputing the whole sequence, to the last bit of the blocking.
"""

from __future__ import annotations

import torch

from cachegen.errors import InputError, KVError
from cachegen.kv import KVCache
from cachegen.models import kv_geometry


def to_dynamic_cache(hf_model, kvs: list[KVCache]):
    """A fresh ``DynamicCache`` holding ``kvs`` as a batch (cast to the model's dtype)."""
    from transformers import DynamicCache

    if not kvs:
        raise KVError("no KV caches to replay")
    geometry = kv_geometry(hf_model.config.to_dict())
    lengths = {kv.num_tokens for kv in kvs}
    for kv in kvs:
        got = {
            "num_layers": kv.num_layers,
            "num_kv_heads": kv.num_kv_heads,
            "head_dim": kv.head_dim,
        }
        if got != geometry:
            raise KVError(f"KV geometry {got} does not fit the model ({geometry})")
        if kv.start != 0:
            raise KVError(
                f"the past must cover the prompt from position 0; this KV starts at {kv.start}"
            )
    if len(lengths) != 1:
        raise KVError(f"KV caches in one batch must have the same length, got {sorted(lengths)}")
    dtype = hf_model.dtype
    cache = DynamicCache(config=hf_model.config)
    for layer in range(geometry["num_layers"]):
        # torch.stack copies, so appending to the cache never writes into the callers' KV.
        keys = torch.stack([kv.keys[layer].to(dtype) for kv in kvs])
        values = torch.stack([kv.values[layer].to(dtype) for kv in kvs])
        cache.update(keys, values, layer)
    return cache


def _forward(hf_model, cache, ids: torch.Tensor, past_len: int) -> torch.Tensor:
    rows, n = ids.shape
    positions = torch.arange(past_len, past_len + n).unsqueeze(0).expand(rows, -1)
    return hf_model(
        input_ids=ids, past_key_values=cache, position_ids=positions, use_cache=True
    ).logits


def _check_room(hf_model, past: int, extra: int) -> None:
    limit = getattr(hf_model.config, "max_position_embeddings", None)
    if limit is not None and past + extra > limit:
        raise InputError(f"{past} past + {extra} new tokens exceed the model's {limit} positions")


@torch.inference_mode()
def continuation_logits(hf_model, kvs: list[KVCache], token_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[len(kvs), len(token_ids), vocab]`` (model dtype) for ``token_ids`` fed after
    each past. Position ``i`` is the distribution of the token that follows ``token_ids[i]``."""
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
    if token_ids.numel() == 0:
        raise InputError("no continuation tokens to score")
    past = kvs[0].num_tokens if kvs else 0
    _check_room(hf_model, past, token_ids.numel())
    cache = to_dynamic_cache(hf_model, kvs)
    return _forward(hf_model, cache, token_ids.unsqueeze(0).expand(len(kvs), -1), past)


@torch.inference_mode()
def greedy_generate(
    hf_model,
    kvs: list[KVCache],
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> list[list[int]]:
    """Greedy continuation of ``prompt_ids`` after each past, one token list per past.

    A row ends after ``max_new_tokens`` or before its first token in ``stop_ids``. Ties in
    the argmax go to the lowest id, so the result is deterministic.
    """
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.int64).flatten()
    if prompt_ids.numel() == 0:
        raise InputError("generation needs at least one prompt token after the past")
    past = kvs[0].num_tokens if kvs else 0
    _check_room(hf_model, past, prompt_ids.numel() + max_new_tokens)
    cache = to_dynamic_cache(hf_model, kvs)
    rows = len(kvs)
    logits = _forward(hf_model, cache, prompt_ids.unsqueeze(0).expand(rows, -1), past)[:, -1]
    past += prompt_ids.numel()
    steps: list[torch.Tensor] = []
    for step in range(max_new_tokens):
        token = logits.float().argmax(dim=-1)
        steps.append(token)
        if step + 1 == max_new_tokens or all(
            any(int(t[r]) in stop_ids for t in steps) for r in range(rows)
        ):
            break
        logits = _forward(hf_model, cache, token.view(rows, 1), past)[:, -1]
        past += 1
    out = []
    for r in range(rows):
        seq = []
        for t in steps:
            if int(t[r]) in stop_ids:
                break
            seq.append(int(t[r]))
        out.append(seq)
    return out
