"""Physical <-> logical KV layouts, checked against vLLM's own cache-writing kernel."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from cachegen.connector.errors import ConnectorError
from cachegen.connector.layouts import (
    CpuPackedLayout,
    SplitLayout,
    block_slots,
    layout_for_layer,
    probe_cpu_packing,
    vec_packing_offsets,
)
from tests.support import require_cpu_kernel

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("isa", ["vec", "vec16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_probe_finds_the_documented_vec_packing(isa, dtype):
    """K transposed per (block, head), then V row-major: the `vec` order in docs/connector.md."""
    keys, values = probe_cpu_packing(isa, 128, 64, dtype)
    want_keys, want_values = vec_packing_offsets(128, 64)
    assert torch.equal(keys, want_keys)
    assert torch.equal(values, want_values)


def test_amx_packing_differs_from_vec():
    require_cpu_kernel("amx", torch.bfloat16)
    keys, _ = probe_cpu_packing("amx", 128, 64, torch.bfloat16)
    assert not torch.equal(keys, vec_packing_offsets(128, 64)[0])


def _kernel_cache(isa, dtype, num_blocks, heads, block_size, head_dim, slots, keys, values):
    """A cache written by vLLM's CPU kernel, exactly as its attention layer writes it."""
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    key_cache, value_cache = cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    return cache


@pytest.mark.parametrize("isa", ["vec", "vec16", "amx"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [32, 128])
def test_cpu_layout_reads_and_writes_what_the_kernel_does(isa, dtype, block_size):
    require_cpu_kernel(isa, dtype)
    torch.manual_seed(0)
    num_blocks, heads, head_dim, tokens = 6, 3, 64, 2 * block_size + 7
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    keys = torch.randn(tokens, heads, head_dim).to(dtype)
    values = torch.randn(tokens, heads, head_dim).to(dtype)
    cache = _kernel_cache(isa, dtype, num_blocks, heads, block_size, head_dim, slots, keys, values)

    key_offsets, value_offsets = probe_cpu_packing(isa, block_size, head_dim, dtype)
    layout = CpuPackedLayout(block_size, heads, head_dim, key_offsets, value_offsets, isa)
    got_keys, got_values = layout.gather(cache, slots)
    assert torch.equal(got_keys, keys.transpose(0, 1))
    assert torch.equal(got_values, values.transpose(0, 1))

    rebuilt = torch.zeros_like(cache)
    layout.scatter(rebuilt, slots, keys.transpose(0, 1), values.transpose(0, 1))
    assert torch.equal(rebuilt, cache)


def test_naive_slot_indexing_of_the_cpu_cache_is_wrong():
    """Why the translation exists: reading [block, :, offset] does not give a token's K."""
    torch.manual_seed(1)
    slots = torch.arange(5, 40)
    keys = torch.randn(35, 2, 64).to(torch.bfloat16)
    cache = _kernel_cache("vec", torch.bfloat16, 2, 2, 128, 64, slots, keys, keys.clone())
    naive = cache[slots // 128, :, slots % 128, :64]
    assert not torch.equal(naive, keys)


def _split_cache(num_blocks, heads, block_size, head_dim, physical_order):
    """A [B, H, N, 2D] logical view over memory laid out in ``physical_order``
    (vLLM's KVCacheLayout)."""
    logical_shape = (num_blocks, heads, block_size, 2 * head_dim)
    physical = torch.zeros(tuple(logical_shape[i] for i in physical_order))
    inverse = [physical_order.index(i) for i in range(4)]
    return physical.permute(*inverse)


@pytest.mark.parametrize("physical_order", [(0, 1, 2, 3), (0, 2, 1, 3)], ids=["HND", "NHD"])
def test_split_layout_round_trip(physical_order):
    torch.manual_seed(2)
    num_blocks, heads, block_size, head_dim = 4, 2, 16, 64
    cache = _split_cache(num_blocks, heads, block_size, head_dim, physical_order)
    slots = torch.randperm(num_blocks * block_size)[:37]
    keys, values = torch.randn(heads, 37, head_dim), torch.randn(heads, 37, head_dim)
    layout = SplitLayout(block_size, heads, head_dim)
    layout.scatter(cache, slots, keys, values)
    # FlashAttention's own reading of the cache: K|V split on the last dim, token-major.
    key_cache, value_cache = cache.transpose(1, 2).split(head_dim, dim=-1)
    blocks, offsets = slots // block_size, slots % block_size
    assert torch.equal(key_cache[blocks, offsets].transpose(0, 1), keys)
    assert torch.equal(value_cache[blocks, offsets].transpose(0, 1), values)
    got_keys, got_values = layout.gather(cache, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


class _Backend:
    def __init__(self, name):
        self.name = name

    def get_name(self):
        return self.name


class _Layer:
    """The attributes of vLLM's Attention layer that the connector reads."""

    def __init__(self, backend, kv_cache_dtype="auto", isa=None):
        self.attn_backend = _Backend(backend)
        self.kv_cache_dtype = kv_cache_dtype
        if isa is not None:
            self.isa = isa


def test_layout_for_supported_backends():
    cache = torch.zeros(2, 3, 128, 128, dtype=torch.bfloat16)
    assert isinstance(layout_for_layer(_Layer("FLASH_ATTN"), cache), SplitLayout)
    cpu = layout_for_layer(_Layer("CPU_ATTN", isa="vec"), cache)
    assert isinstance(cpu, CpuPackedLayout) and (
        cpu.block_size,
        cpu.num_kv_heads,
        cpu.head_dim,
    ) == (128, 3, 64)


@pytest.mark.parametrize(
    "layer, message",
    [
        (_Layer("FLASHINFER"), "FLASHINFER is not supported"),
        (_Layer("FLASH_ATTN", kv_cache_dtype="fp8"), "KV cache dtype 'fp8'"),
        (_Layer("CPU_ATTN"), "no kernel ISA"),
        (_Layer("CPU_ATTN", isa="neon"), "rejects isa='neon'"),
    ],
)
def test_unsupported_layouts_fail_clearly(layer, message):
    with pytest.raises(ConnectorError, match=message):
        layout_for_layer(layer, torch.zeros(2, 3, 128, 128, dtype=torch.bfloat16))


def test_scatter_rejects_mismatched_kv():
    layout = SplitLayout(16, 2, 64)
    with pytest.raises(ConnectorError, match="do not fit"):
        layout.scatter(
            torch.zeros(2, 2, 16, 128),
            torch.arange(4),
            torch.zeros(2, 5, 64),
            torch.zeros(2, 5, 64),
        )


@pytest.mark.parametrize(
    "isa,dtype", [("vec", torch.bfloat16), ("vec", torch.float32), ("amx", torch.bfloat16)]
)
def test_whole_block_paths_match_the_kernel(isa, dtype):
    require_cpu_kernel(isa, dtype)
    torch.manual_seed(3)
    num_blocks, heads, block_size, head_dim = 6, 3, 128, 64
    blocks = torch.tensor([4, 1, 3])
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    layers = [
        (
            torch.randn(len(slots), heads, head_dim).to(dtype),
            torch.randn(len(slots), heads, head_dim).to(dtype),
        )
        for _ in range(2)
    ]
    caches = [
        _kernel_cache(isa, dtype, num_blocks, heads, block_size, head_dim, slots, k, v)
        for k, v in layers
    ]
    keys = torch.stack([k.transpose(0, 1) for k, _ in layers])  # [layers, H, n, D]
    values = torch.stack([v.transpose(0, 1) for _, v in layers])
    key_offsets, value_offsets = probe_cpu_packing(isa, block_size, head_dim, dtype)
    layout = CpuPackedLayout(block_size, heads, head_dim, key_offsets, value_offsets, isa)
    assert layout.is_vec == (isa == "vec")
    got_keys, got_values = layout.read(caches, block_slots(blocks, layout.block_size))
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    rebuilt = [torch.zeros_like(c) for c in caches]
    layout.write(rebuilt, block_slots(blocks, layout.block_size), (keys, values))
    assert all(torch.equal(a, b) for a, b in zip(rebuilt, caches))


def test_split_layout_whole_blocks():
    torch.manual_seed(4)
    caches = [_split_cache(5, 2, 16, 64, (0, 2, 1, 3)) for _ in range(2)]
    layout = SplitLayout(16, 2, 64)
    blocks = torch.tensor([3, 0])
    keys, values = torch.randn(2, 2, 32, 64), torch.randn(2, 2, 32, 64)
    layout.write(caches, block_slots(blocks, layout.block_size), (keys, values))
    slots = (blocks[:, None] * 16 + torch.arange(16)).flatten()
    for layer, cache in enumerate(caches):
        assert all(
            torch.equal(a, b)
            for a, b in zip(layout.gather(cache, slots), (keys[layer], values[layer]))
        )
    assert all(
        torch.equal(a, b)
        for a, b in zip(layout.read(caches, block_slots(blocks, layout.block_size)), (keys, values))
    )
