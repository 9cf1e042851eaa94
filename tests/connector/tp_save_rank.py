"""One tensor-parallel rank of the connector's save path, without vLLM's engine: a real
``WorkerSide`` (paged caches of this rank's KV heads, the real transport on a directory store)
and a real gloo process group with the other ranks, which run this script too.

``python tests/connector/tp_save_rank.py RANK SIZE PORT STORE_URL:FAILING_RANK ...`` saves, for
each store given, one prompt of tiny-llama KV (every head, seeded) through a fresh worker: the
rank numbered FAILING_RANK (-1: none) has caches too small for the prompt's blocks, so its read
fails, as a rank's read of a prompt may. Run by tests/connector/test_head_shards.py.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from cachegen.connector.config import ConnectorConfig
from cachegen.connector.head_shards import HeadExchange, HeadShard
from cachegen.connector.metadata import SaveTask, StepMetadata
from cachegen.connector.paged_cache import CacheGroup
from cachegen.connector.transport import ChunkTransport
from cachegen.connector.worker import WorkerSide
from cachegen.kv import KVCache
from cachegen.models import resolve

CHUNK, BLOCK, TOKENS = 64, 16, 128
BLOCK_IDS = list(range(1, TOKENS // BLOCK + 1))
LAYER = "model.layers.{}.self_attn.attn"


class _Layer:
    """The attributes of vLLM's Attention layer that the layout lookup reads."""

    class attn_backend:  # noqa: N801 - mirrors vLLM's attribute
        @staticmethod
        def get_name():
            return "FLASH_ATTN"

    kv_cache_dtype = "auto"


def prompt_kv(spec) -> KVCache:
    """The prompt's KV of every head, the same on every rank (and in the test)."""
    model = spec.identity()
    generator = torch.Generator().manual_seed(7)
    shape = (model.num_layers, model.num_kv_heads, TOKENS, model.head_dim)
    return KVCache(
        keys=torch.randn(shape, generator=generator).to(torch.bfloat16),
        values=torch.randn(shape, generator=generator).to(torch.bfloat16),
        token_ids=torch.arange(1000, 1000 + TOKENS),
        model=model,
    )


def main(rank: int, size: int, port: int, runs: list[tuple[str, int]]) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    for store, failing_rank in runs:
        save_once(rank, size, store, failing_rank)
    dist.destroy_process_group()


def save_once(rank: int, size: int, store: str, failing_rank: int) -> None:
    spec = resolve("tiny-llama")
    model = spec.identity()
    config = ConnectorConfig.from_extra_config(
        {"store": store, "chunk_tokens": CHUNK, "save_modes": ["raw"], "save_async": False}
    )
    shard = HeadShard(rank, size, model.num_kv_heads)
    transport = ChunkTransport(config, spec, model)
    worker = WorkerSide(
        transport.loader,
        transport.writer,
        transport.close,
        model,
        [CacheGroup(None, BLOCK)],
        CHUNK,
        save_async=False,
        exchange=HeadExchange(shard, dist.group.WORLD),
    )
    heads = shard.heads.stop - shard.heads.start
    blocks = 2 if rank == failing_rank else len(BLOCK_IDS) + 1
    caches = {
        LAYER.format(i): torch.zeros(blocks, heads, BLOCK, 2 * model.head_dim, dtype=torch.bfloat16)
        for i in range(model.num_layers)
    }
    worker.register(caches, {name: _Layer() for name in caches})
    kv = prompt_kv(spec)
    if rank != failing_rank:
        assert worker.cache.inject([BLOCK_IDS], kv, 0, TOKENS) == TOKENS
    task = SaveTask("prompt", kv.token_ids.tolist(), [BLOCK_IDS], ("raw",), save_id=1)
    worker.submit_saves(StepMetadata(step_tokens=TOKENS, saves=[task]))
    worker.shutdown()


if __name__ == "__main__":
    stores = [arg.rsplit(":", 1) for arg in sys.argv[4:]]
    main(*(int(arg) for arg in sys.argv[1:4]), [(url, int(fail)) for url, fail in stores])
