"""One worker's view of vLLM's paged KV cache: every layer's cache tensor, their common
layout, and KV moved between them and ``KVCache`` at a request's block ids.

vLLM's hybrid KV cache manager (HMA) puts the layers of each attention kind in their own KV
cache groups, each with its own block table and block size; a sliding-window group holds the
null block (id 0) for tokens behind its window, which is never read nor written here. With
HMA off every layer is in one group. With tensor parallelism a worker's caches hold its
rank's KV heads only (``HeadShard``): it reads those and writes those.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from cachegen.connector.errors import ConnectorError
from cachegen.connector.head_shards import Heads, HeadShard
from cachegen.connector.layouts import CpuPackedLayout, PagedLayout, layout_for_layer
from cachegen.kv import KVCache, ModelIdentity

logger = logging.getLogger(__name__)

NULL_BLOCK = 0  # vLLM's placeholder for the blocks a sliding-window group does not keep


@dataclass(frozen=True)
class CacheGroup:
    """One of vLLM's KV cache groups: its layers' names (None: every layer) and block size."""

    layer_names: frozenset[str] | None
    block_size: int


def cache_groups(kv_cache_config: Any, block_size: int) -> list[CacheGroup]:
    """The KV cache groups of vLLM's ``KVCacheConfig``, in vLLM's order (the order of the
    block id lists it hands the connector); one group of every layer without a config."""
    if kv_cache_config is None:
        return [CacheGroup(None, block_size)]
    return [
        CacheGroup(frozenset(group.layer_names), group.kv_cache_spec.block_size)
        for group in kv_cache_config.kv_cache_groups
    ]


def held_from(block_ids: list[int], block_size: int) -> int:
    """The first token of a group's block table past its leading null blocks."""
    nulls = 0
    while nulls < len(block_ids) and block_ids[nulls] == NULL_BLOCK:
        nulls += 1
    return nulls * block_size


class PagedCache:
    """The paged caches of ``model``'s layers in vLLM's KV cache ``groups``; block ids refer
    to each group's block size."""

    def __init__(
        self,
        model: ModelIdentity,
        groups: list[CacheGroup],
        windows: tuple[int | None, ...] | None,
        shard: HeadShard | None = None,
    ) -> None:
        self.model = model
        self.groups = groups
        self.shard = shard or HeadShard(0, 1, model.num_kv_heads)
        # Each layer's attention window (None: full), recorded on the KV read out for saving.
        self.windows = windows
        self._caches: list[torch.Tensor] = []  # one per layer, in layer order
        self._group_layers: list[list[int]] = []  # each group's layer indices, ascending
        self._layout: PagedLayout | None = None  # the same for every layer

    @property
    def dtype(self) -> torch.dtype:
        return self._caches[0].dtype

    def register(self, kv_caches: dict[str, torch.Tensor], layers: dict[str, Any]) -> None:
        """Order the per-layer caches by layer index, learn each one's layout and group."""
        from vllm.model_executor.models.utils import extract_layer_index

        indexed = sorted((extract_layer_index(name), name) for name in kv_caches)
        if [i for i, _ in indexed] != list(range(self.model.num_layers)):
            raise ConnectorError(
                f"vLLM has attention caches for layers {[i for i, _ in indexed]}, "
                f"but {self.model.name} has {self.model.num_layers} layers; "
                "cross-layer or shared KV caches are not supported"
            )
        caches, layouts = [], []
        for _, name in indexed:
            cache = kv_caches[name]
            layout = layout_for_layer(layers[name], cache)
            self._check(name, cache, layout)
            if layouts and (layout != layouts[0] or cache.dtype != caches[0].dtype):
                raise ConnectorError(
                    f"layer {name} has another KV layout or dtype than layer 0; "
                    "mixed layouts are not supported"
                )
            caches.append(cache)
            layouts.append(layout)
        self._caches, self._layout = caches, layouts[0]
        self._group_layers = [
            [i for i, name in indexed if group.layer_names is None or name in group.layer_names]
            for group in self.groups
        ]
        extra = (
            f", isa {self._layout.isa}, vec packing {self._layout.is_vec}"
            if isinstance(self._layout, CpuPackedLayout)
            else ""
        )
        logger.info(
            "cachegen connector: %d layers in %d KV cache groups, %s layout (kernel block %d%s)",
            len(caches),
            len(self.groups),
            self._layout.kind,
            self._layout.block_size,
            extra,
        )

    def _check(self, name: str, cache: torch.Tensor, layout: PagedLayout) -> None:
        """Refuse a layer's cache that does not hold this model's KV in whole kernel blocks."""
        layout.check_cache(cache)
        heads = self.shard.heads
        if (layout.num_kv_heads, layout.head_dim) != (
            heads.stop - heads.start,
            self.model.head_dim,
        ):
            raise ConnectorError(
                f"layer {name}: vLLM holds {layout.num_kv_heads} KV heads x "
                f"{layout.head_dim}, rank {self.shard.rank} of {self.shard.size} of "
                f"{self.model.name} should hold {heads.stop - heads.start} x "
                f"{self.model.head_dim}"
            )
        for group in self.groups:
            if group.block_size % layout.block_size:
                raise ConnectorError(
                    f"kernel block size {layout.block_size} does not divide block size "
                    f"{group.block_size}"
                )

    def _slots(self, group: int, block_ids: list[int], begin: int, end: int):
        """Slots of tokens ``[begin, end)`` in ``group``, and which of them the group keeps
        (those outside the null block)."""
        block_size = self.groups[group].block_size
        positions = torch.arange(begin, end)
        blocks = torch.as_tensor(block_ids, dtype=torch.int64)[positions // block_size]
        return blocks * block_size + positions % block_size, blocks != NULL_BLOCK

    def read(self, block_ids: list[list[int]], begin: int, end: int) -> Heads:
        """This rank's heads of the KV of prompt tokens ``[begin, end)`` (a copy; zeros where a
        group holds the null block); ``block_ids``: one list per KV cache group."""
        assert self._layout is not None
        parts = []
        for group, layers in enumerate(self._group_layers):
            slots, kept = self._slots(group, block_ids[group], begin, end)
            keys, values = self._layout.read([self._caches[i] for i in layers], slots[kept])
            if not bool(kept.all()):
                keys, values = _spread(keys, kept), _spread(values, kept)
            parts.append((layers, keys.cpu(), values.cpu()))
        return _in_layer_order(parts, self.model.num_layers)

    def as_kv(self, heads: Heads, token_ids: list[int], begin: int) -> KVCache:
        """Every head's KV (``read``'s, or every rank's gathered) of the prompt tokens from
        ``begin`` on."""
        keys, values = heads
        return KVCache(
            keys=keys,
            values=values,
            token_ids=torch.as_tensor(token_ids[begin : begin + keys.shape[2]], dtype=torch.int64),
            model=self.model,
            start=begin,
            windows=self.windows,
        )

    def inject(self, block_ids: list[list[int]], kv: KVCache, begin: int, end: int) -> int:
        """Write the part of ``kv`` inside tokens ``[begin, end)`` into the blocks each group
        keeps (into the layers ``kv`` holds; a layer subset leaves the other layers' slots
        untouched)."""
        assert self._layout is not None
        lo, hi = max(begin, kv.start), min(end, kv.start + kv.num_tokens)
        if lo >= hi:
            return 0
        part = kv.slice(lo - kv.start, hi - kv.start)
        keys, values = part.keys, part.values
        if self.shard.size > 1:
            keys, values = keys[:, self.shard.heads], values[:, self.shard.heads]
        row_of = {layer: row for row, layer in enumerate(part.layer_indices)}
        for group, layers in enumerate(self._group_layers):
            rows = [row_of[i] for i in layers if i in row_of]
            if not rows:
                continue
            slots, kept = self._slots(group, block_ids[group], lo, hi)
            pair = (_select(keys, rows, kept), _select(values, rows, kept))
            caches = [self._caches[i] for i in layers if i in row_of]
            self._layout.write(caches, slots[kept], pair)
        return hi - lo


def _select(kv: torch.Tensor, rows: list[int], kept: torch.Tensor) -> torch.Tensor:
    """Layer rows ``rows`` of ``kv`` at the ``kept`` token positions (``kv`` itself when that
    is all of it: one KV cache group)."""
    if rows != list(range(kv.shape[0])):
        kv = kv[rows]
    return kv if bool(kept.all()) else kv[:, :, kept]


def _spread(kv: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``kv`` (tokens on dim 2) placed at the ``kept`` positions of a zero tensor."""
    out = kv.new_zeros(kv.shape[0], kv.shape[1], kept.numel(), kv.shape[3])
    out[:, :, kept] = kv
    return out


def _in_layer_order(parts: list, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every layer from per-group ``(layers, keys, values)`` parts."""
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    keys = [None] * num_layers
    values = [None] * num_layers
    for layers, group_keys, group_values in parts:
        for row, layer in enumerate(layers):
            keys[layer], values[layer] = group_keys[row], group_values[row]
    return torch.stack(keys), torch.stack(values)
