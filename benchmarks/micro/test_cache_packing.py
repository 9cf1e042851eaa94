"""Moving KV in and out of vLLM's CPU paged cache (pytest-benchmark; skipped by `--benchmark-skip`).

    .venv/bin/pytest benchmarks/micro/test_cache_packing.py --benchmark-only

What the connector does per load and per save (docs/connector.md, "Backend layouts"): the
KV of 4,096 SmolLM2 tokens (30 layers, 3 KV heads x 64) written into, and read out of, the
``vec`` packing of vLLM's CPU attention (128-token blocks, keys transposed per block and
head), in 256-token chunks as a load injects them. Needs no vLLM: the packing is the one
the layout tests check against vLLM's own kernel.
"""

from __future__ import annotations

import pytest
import torch

from cachegen.connector.layouts import CpuPackedLayout, block_slots, vec_packing_offsets
from tests.support import CHUNK

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 128
TOKENS = 4096


@pytest.fixture(scope="module")
def packed():
    layout = CpuPackedLayout(BLOCK, HEADS, HEAD_DIM, *vec_packing_offsets(BLOCK, HEAD_DIM))
    num_blocks = TOKENS // BLOCK + 8  # vLLM hands out blocks in any order: use a shuffled set
    caches = [
        torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[
        : TOKENS // BLOCK
    ]
    chunks = [
        torch.randn(2, LAYERS, HEADS, CHUNK, HEAD_DIM, dtype=torch.bfloat16)
        for _ in range(TOKENS // CHUNK)
    ]
    return layout, caches, order.view(-1, CHUNK // BLOCK), chunks


def _record(benchmark):
    benchmark.extra_info.update(
        {"elements": 2 * LAYERS * HEADS * TOKENS * HEAD_DIM, "tokens": TOKENS}
    )


def test_inject_chunks(benchmark, packed):
    layout, caches, blocks, chunks = packed

    def inject():
        for chunk_blocks, kv in zip(blocks, chunks):
            layout.write(caches, block_slots(chunk_blocks, layout.block_size), (kv[0], kv[1]))

    _record(benchmark)
    benchmark(inject)
    keys, values = layout.read(caches, block_slots(blocks[-1], layout.block_size))
    assert torch.equal(keys, chunks[-1][0]) and torch.equal(values, chunks[-1][1])


def test_gather_prompt(benchmark, packed):
    layout, caches, blocks, chunks = packed
    for chunk_blocks, kv in zip(blocks, chunks):
        layout.write(caches, block_slots(chunk_blocks, layout.block_size), (kv[0], kv[1]))
    _record(benchmark)
    keys, _ = benchmark(layout.read, caches, block_slots(blocks.flatten(), layout.block_size))
    assert torch.equal(keys[:, :, :CHUNK], chunks[0][0])
