"""KV moved between ``KVCache`` and vLLM's paged cache in several KV cache groups (vLLM's hybrid
KV cache manager): each group's own block table, and the null block (id 0) that a
sliding-window group holds behind its window is never read nor written."""

from __future__ import annotations

import torch

from cachegen.connector.paged_cache import CacheGroup, PagedCache, held_from
from cachegen.kv import KVCache, ModelIdentity

BLOCK, HEADS, DIM, TOKENS = 16, 1, 8, 64
LAYER = "model.layers.{}.self_attn.attn"
SENTINEL = 7.0


class _Layer:
    """The attributes of vLLM's Attention layer that the layout lookup reads."""

    class attn_backend:  # noqa: N801 - mirrors vLLM's attribute
        @staticmethod
        def get_name():
            return "FLASH_ATTN"

    kv_cache_dtype = "auto"


def _cache() -> PagedCache:
    """Layers 0 and 1 in a sliding-window group, layer 2 in a full-attention group."""
    model = ModelIdentity("three-layers", "test", 3, HEADS, DIM)
    groups = [
        CacheGroup(frozenset({LAYER.format(0), LAYER.format(1)}), BLOCK),
        CacheGroup(frozenset({LAYER.format(2)}), BLOCK),
    ]
    cache = PagedCache(model, groups, None)
    tensors = {LAYER.format(i): torch.zeros(10, HEADS, BLOCK, 2 * DIM) for i in range(3)}
    for tensor in tensors.values():
        tensor[0] = SENTINEL  # the null block
    cache.register(tensors, {name: _Layer() for name in tensors})
    return cache


def _kv(model: ModelIdentity) -> KVCache:
    torch.manual_seed(0)
    shape = (3, HEADS, TOKENS, DIM)
    return KVCache(
        keys=torch.randn(shape),
        values=torch.randn(shape),
        token_ids=torch.arange(TOKENS),
        model=model,
    )


# The sliding group keeps only the last two blocks (the first two are the null block).
BLOCK_IDS = [[0, 0, 3, 4], [5, 6, 7, 8]]


def test_each_group_is_written_at_its_own_blocks_and_the_null_block_never():
    cache = _cache()
    kv = _kv(cache.model)
    assert cache.inject(BLOCK_IDS, kv, 0, TOKENS) == TOKENS
    for tensor in cache._caches:
        assert bool((tensor[0] == SENTINEL).all())
    back = cache.as_kv(cache.read(BLOCK_IDS, 0, TOKENS), list(range(TOKENS)), 0)
    assert torch.equal(back.keys[2], kv.keys[2]) and torch.equal(back.values[2], kv.values[2])
    kept = slice(2 * BLOCK, TOKENS)
    assert torch.equal(back.keys[:2, :, kept], kv.keys[:2, :, kept])
    assert torch.equal(back.values[:2, :, kept], kv.values[:2, :, kept])
    # Tokens behind the window are not read: zeros.
    assert not back.keys[:2, :, : 2 * BLOCK].any()


def test_a_layer_subset_is_written_only_into_its_layers():
    cache = _cache()
    kv = _kv(cache.model).select_layers([0, 1])
    cache.inject(BLOCK_IDS, kv, 0, TOKENS)
    assert not cache._caches[2][5:9].any()
    assert cache._caches[0][3:5].any()


def test_held_from_skips_the_leading_null_blocks():
    assert held_from([0, 0, 3, 4], BLOCK) == 2 * BLOCK
    assert held_from([5, 6], BLOCK) == 0
    assert held_from([], BLOCK) == 0
