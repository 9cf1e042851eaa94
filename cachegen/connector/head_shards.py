"""Tensor parallelism: the KV heads one rank holds, and the exchange that makes a save whole.

With tensor parallelism vLLM gives each worker the KV of some heads: rank r of t holds heads
``[r*H/t, (r+1)*H/t)`` of the model's H KV heads when t divides H, and head ``r*H//t`` (each
head replicated on t/H ranks) when H divides t. The store keeps the model's KV, every head in
one chunk, so that engines of any TP size share chunks: before a save, the group's first rank
(the leader) gathers every rank's heads and alone encodes and stores; a load reads and decodes
whole chunks on every rank, and each rank writes its own heads into its paged cache.

Every rank takes part in the exchange of every save of a step, ready or not: the ranks first
agree which prompts every one of them has read (a rank whose read failed, or whose inline load
of that request did, is not ready), and only those prompts are gathered. A prompt one rank
could not read is stored by no rank, so the store never holds a chunk with some heads missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cachegen.connector.errors import ConnectorError

Heads = tuple[torch.Tensor, torch.Tensor]  # keys and values [layers, heads, tokens, head_dim]


@dataclass(frozen=True)
class HeadShard:
    """Rank ``rank`` of ``size`` tensor-parallel ranks of a model with ``num_heads`` KV heads."""

    rank: int
    size: int
    num_heads: int

    def __post_init__(self) -> None:
        if self.num_heads % self.size and self.size % self.num_heads:
            raise ConnectorError(
                f"tensor_parallel_size={self.size} neither divides nor is a multiple of the "
                f"model's {self.num_heads} KV heads; choose a TP size that is"
            )

    @property
    def heads(self) -> slice:
        """The model's KV heads this rank holds."""
        start = self.rank * self.num_heads // self.size
        return slice(start, start + max(1, self.num_heads // self.size))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def owners(self) -> list[int]:
        """The ranks whose heads make up the model's, in head order (one per replicated head)."""
        firsts: dict[int, int] = {}
        for rank in range(self.size):
            firsts.setdefault(HeadShard(rank, self.size, self.num_heads).heads.start, rank)
        return [firsts[start] for start in sorted(firsts)]


class HeadExchange:
    """The save-time exchange of one rank's heads over a ``torch.distributed`` group (gloo:
    the exchanged KV is in host memory already); no group with one rank."""

    def __init__(self, shard: HeadShard, group: Any = None) -> None:
        if shard.size > 1 and group is None:
            raise ConnectorError("tensor parallelism needs the ranks' process group")
        self.shard = shard
        self._group = group

    def whole(self, reads: list[Heads | None]) -> list[Heads | None]:
        """Every rank's heads of each prompt of a step (``reads``: this rank's, None where it
        has none): on the leader, the model's heads of the prompts every rank read, else None;
        on the other ranks, None throughout. Every rank must call this in every step that has
        saves, with as many entries."""
        if self.shard.size == 1:
            return list(reads)
        ready = self._agree([read is not None for read in reads])
        return [self._gather(read) if ok else None for read, ok in zip(reads, ready, strict=True)]

    def _agree(self, ready: list[bool]) -> list[bool]:
        import torch.distributed as dist

        flags = torch.tensor(ready, dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self._group)
        return [bool(flag) for flag in flags.tolist()]

    def _gather(self, read: Heads | None) -> Heads | None:
        import torch.distributed as dist

        assert read is not None
        local = torch.stack(read)  # [2, layers, heads, tokens, head_dim]
        # Sent as bytes: gloo reduces no bf16, and a gather of bytes is exact for every dtype.
        sent = local.contiguous().view(-1).view(torch.uint8)
        leader = dist.get_global_rank(self._group, 0)
        parts = (
            [torch.empty_like(sent) for _ in range(self.shard.size)]
            if self.shard.is_leader
            else None
        )
        dist.gather(sent, parts, dst=leader, group=self._group)
        if parts is None:
            return None
        heads = [parts[rank].view(local.dtype).view(local.shape) for rank in self.shard.owners()]
        whole = torch.cat(heads, dim=2)
        return whole[0], whole[1]


def tensor_parallel_shard(num_heads: int, tp_size: int) -> tuple[HeadShard, Any]:
    """This worker's shard and, with ``tp_size`` above 1, its TP group's host-side process
    group (vLLM's ``tp_group``, set up before the worker's connector)."""
    if tp_size == 1:
        return HeadShard(0, 1, num_heads), None
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return HeadShard(group.rank_in_group, group.world_size, num_heads), group.cpu_group
