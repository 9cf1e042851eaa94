"""Translation between vLLM's physical paged KV caches and the library's logical layout.

vLLM hands every attention layer's cache to a connector as one tensor with the logical
shape ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``. What the memory behind it
means depends on the attention backend:

* ``split`` (FLASH_ATTN, TRITON_ATTN, FLEX_ATTENTION): the view means what it says. Token
  ``o`` of block ``b``, head ``h`` has its key in ``[b, h, o, :head_size]`` and its value in
  ``[b, h, o, head_size:]``; the physical order of the axes may be permuted (vLLM's
  ``KVCacheLayout``), which strided indexing handles.
* ``cpu-packed`` (CPU_ATTN): the view is only a container. The kernel reinterprets each
  (block, head) as ``2 * block_size * head_size`` elements: the first half holds the keys,
  the second half the values, in an ISA-specific order. With the ``vec``/``vec16`` kernels
  (AVX-512/AVX2) keys are stored transposed (``[head_size, block_size]``) and values row-major
  (``[block_size, head_size]``); the ``amx`` kernel interleaves pairs of rows for VNNI tiles.
  Indexing the view at a token's slot does NOT give that token's K/V.

For ``cpu-packed`` we do not re-implement each ISA's order from vLLM's C++ source: at start-up
we run vLLM's own ``cpu_attn_reshape_and_cache`` kernel once on a scratch block whose values
encode their logical position, read back where every (token, channel) landed, and check the
result is a permutation. The connector therefore reads and writes exactly what the attention
kernel reads, for whichever ISA vLLM picked, and an ISA whose packing is not a permutation of
one block fails at start-up instead of loading wrong KV.

All functions take and return K/V of one layer as ``[num_kv_heads, num_tokens, head_dim]``
(one layer of ``cachegen.kv.KVCache``); tokens are addressed by vLLM slot numbers
``block_id * block_size + offset``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from cachegen.connector.errors import ConnectorError

# Backends whose per-layer view splits K and V on the last dimension (read from vLLM 0.32's
# FlashAttention/Triton/Flex implementations: ``kv_cache.transpose(1, 2).split(head_size, -1)``).
SPLIT_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})
CPU_BACKEND = "CPU_ATTN"
# The probe encodes positions as base-128 digits: 0..127 for keys, 128..255 for values, all
# exactly representable in bf16, fp16 and fp32.
_DIGIT_BASE = 128

Pair = tuple[torch.Tensor, torch.Tensor]  # K and V


class PagedLayout:
    """Where each token's K and V live inside one layer's paged cache tensor."""

    kind: str
    block_size: int
    num_kv_heads: int
    head_dim: int

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> Pair:
        """K and V ``[num_kv_heads, len(slots), head_dim]`` of the tokens at ``slots``."""
        raise NotImplementedError

    def scatter(
        self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write K and V ``[num_kv_heads, len(slots), head_dim]`` into the tokens at ``slots``."""
        raise NotImplementedError

    # All layers at once: the worker moves a chunk's KV of every layer in one call, so a layout
    # can do it in one pass (the CPU vec packing: one release of the GIL per chunk). Whole
    # blocks are the common case (chunks and vLLM's hits are block-aligned); layouts move a
    # block's run at once, several times faster than per-token indexing.

    def read(self, caches: Sequence[torch.Tensor], slots: torch.Tensor) -> Pair:
        """K and V ``[len(caches), num_kv_heads, len(slots), head_dim]`` of the tokens at
        ``slots``, one cache per layer."""
        blocks = whole_blocks(slots, self.block_size)
        if blocks is None:
            return _stack_layers(self.gather(cache, slots) for cache in caches)
        return self._read_blocks(caches, blocks)

    def write(self, caches: Sequence[torch.Tensor], slots: torch.Tensor, kv: Pair) -> None:
        """Write K and V ``kv`` (each ``[len(caches), num_kv_heads, len(slots), head_dim]``)
        into the tokens at ``slots``, one cache per layer."""
        blocks = whole_blocks(slots, self.block_size)
        if blocks is None:
            for layer, cache in enumerate(caches):
                self.scatter(cache, slots, kv[0][layer], kv[1][layer])
        else:
            self._write_blocks(caches, blocks, kv)

    def _read_blocks(self, caches: Sequence[torch.Tensor], blocks: torch.Tensor) -> Pair:
        return _stack_layers(self._gather_layer_blocks(cache, blocks) for cache in caches)

    def _write_blocks(self, caches: Sequence[torch.Tensor], blocks: torch.Tensor, kv: Pair) -> None:
        for layer, cache in enumerate(caches):
            self._scatter_layer_blocks(cache, blocks, kv[0][layer], kv[1][layer])

    def _gather_layer_blocks(self, cache: torch.Tensor, blocks: torch.Tensor) -> Pair:
        return self.gather(cache, block_slots(blocks, self.block_size))

    def _scatter_layer_blocks(
        self, cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        self.scatter(cache, block_slots(blocks, self.block_size), keys, values)

    def check_cache(self, cache: torch.Tensor) -> None:
        expected = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if cache.dim() != 4 or tuple(cache.shape[1:]) != expected:
            raise ConnectorError(
                f"{self.kind} layout expects a cache of shape "
                f"[blocks, {expected[0]}, {expected[1]}, {expected[2]}], got {tuple(cache.shape)}"
            )

    def _check_kv(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        shape = (self.num_kv_heads, slots.numel(), self.head_dim)
        if tuple(keys.shape) != shape or tuple(values.shape) != shape:
            raise ConnectorError(
                f"K/V of shapes {tuple(keys.shape)}/{tuple(values.shape)} do not fit "
                f"{slots.numel()} slots of {self.num_kv_heads} heads x {self.head_dim} channels"
            )


@dataclass
class SplitLayout(PagedLayout):
    """K in ``[..., :head_dim]``, V in ``[..., head_dim:]`` of the ``[B, H, N, 2D]`` view."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    kind: str = "split"

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> Pair:
        slots = slots.to(cache.device)
        rows = cache[slots // self.block_size, :, slots % self.block_size]  # [n, H, 2D]
        rows = rows.transpose(0, 1)
        return rows[..., : self.head_dim], rows[..., self.head_dim :]

    def scatter(
        self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        self._check_kv(slots, keys, values)
        slots = slots.to(cache.device)
        rows = (
            torch.cat([keys, values], dim=-1)
            .transpose(0, 1)
            .to(device=cache.device, dtype=cache.dtype)
        )
        cache[slots // self.block_size, :, slots % self.block_size] = rows

    def _gather_layer_blocks(self, cache: torch.Tensor, blocks: torch.Tensor) -> Pair:
        runs = cache[blocks.to(cache.device)]  # [n, H, bs, 2D]
        rows = runs.transpose(0, 1).reshape(self.num_kv_heads, -1, 2 * self.head_dim)
        return rows[..., : self.head_dim], rows[..., self.head_dim :]

    def _scatter_layer_blocks(
        self, cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        self._check_kv(block_slots(blocks, self.block_size), keys, values)
        rows = torch.cat([keys, values], dim=-1).to(device=cache.device, dtype=cache.dtype)
        cache[blocks.to(cache.device)] = rows.view(
            self.num_kv_heads, len(blocks), self.block_size, -1
        ).transpose(0, 1)


@dataclass
class CpuPackedLayout(PagedLayout):
    """vLLM CPU attention: each (block, head) is a packed ``2 * block_size * head_dim`` run.

    ``key_offsets[o, d]`` / ``value_offsets[o, d]`` give the position, inside that run, of
    channel ``d`` of the token at offset ``o`` in the block.
    """

    block_size: int
    num_kv_heads: int
    head_dim: int
    # Not compared: they follow from the ISA, block size and head size (and tensors do not
    # compare to one bool).
    key_offsets: torch.Tensor = field(repr=False, compare=False)
    value_offsets: torch.Tensor = field(repr=False, compare=False)
    isa: str = "vec"
    kind: str = "cpu-packed"

    def __post_init__(self) -> None:
        vec_keys, vec_values = vec_packing_offsets(self.block_size, self.head_dim)
        # The vec packing is two strided copies per block (K transposed, V as is).
        self.is_vec = torch.equal(self.key_offsets, vec_keys) and torch.equal(
            self.value_offsets, vec_values
        )

    def _runs(self, cache: torch.Tensor) -> torch.Tensor:
        if not cache.is_contiguous():
            raise ConnectorError(
                "the CPU KV cache tensor is not contiguous; this vLLM layout is not supported"
            )
        return cache.view(cache.shape[0], self.num_kv_heads, 2 * self.block_size * self.head_dim)

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> Pair:
        runs = self._runs(cache)
        blocks = (slots // self.block_size)[:, None]
        offsets = slots % self.block_size
        # Advanced indices around a slice put their dims first: [n, D, H] -> [H, n, D].
        keys = runs[blocks, :, self.key_offsets[offsets]].permute(2, 0, 1)
        values = runs[blocks, :, self.value_offsets[offsets]].permute(2, 0, 1)
        return keys, values

    def scatter(
        self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        self._check_kv(slots, keys, values)
        runs = self._runs(cache)
        blocks = (slots // self.block_size)[:, None]
        offsets = slots % self.block_size
        runs[blocks, :, self.key_offsets[offsets]] = keys.permute(1, 2, 0).to(cache.dtype)
        runs[blocks, :, self.value_offsets[offsets]] = values.permute(1, 2, 0).to(cache.dtype)

    # The vec packing (K transposed, V as is, per block and head) moves through numba
    # kernels, one call for all layers: per-block torch copies are slower, and a single
    # batched permute-copy far slower (torch's strided bf16 copies are slow). Measurements:
    # docs/connector.md, "Backend layouts"; benchmarks/micro/test_cache_packing.py.

    def _runs_bits(self, caches: Sequence[torch.Tensor]) -> tuple[np.ndarray, ...]:
        """Each layer's runs ``[blocks, H, 2, block_size * head_dim]`` as integer arrays."""
        return tuple(
            _as_bits(self._runs(c).view(c.shape[0], self.num_kv_heads, 2, -1)) for c in caches
        )

    def _read_blocks(self, caches: Sequence[torch.Tensor], blocks: torch.Tensor) -> Pair:
        if not self.is_vec:
            return super()._read_blocks(caches, blocks)
        from cachegen.connector.packing_kernels import gather_vec_blocks

        shape = (len(caches), self.num_kv_heads, len(blocks) * self.block_size, self.head_dim)
        keys = torch.empty(shape, dtype=caches[0].dtype)
        values = torch.empty_like(keys)
        gather_vec_blocks(
            self._runs_bits(caches),
            blocks.numpy().astype("int64"),
            _as_bits(keys),
            _as_bits(values),
        )
        return keys, values

    def _write_blocks(self, caches: Sequence[torch.Tensor], blocks: torch.Tensor, kv: Pair) -> None:
        if not self.is_vec:
            return super()._write_blocks(caches, blocks, kv)
        from cachegen.connector.packing_kernels import scatter_vec_blocks

        keys, values = kv
        slots = block_slots(blocks, self.block_size)
        for layer in range(len(caches)):
            self._check_kv(slots, keys[layer], values[layer])
        dtype = caches[0].dtype
        scatter_vec_blocks(
            self._runs_bits(caches),
            blocks.numpy().astype("int64"),
            _as_bits(keys.to(dtype)),
            _as_bits(values.to(dtype)),
        )


def whole_blocks(slots: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """The blocks (of ``block_size`` slots) that ``slots`` fill exactly, in order, or None if
    they do not."""
    n = slots.numel()
    if n == 0 or n % block_size or int(slots[0]) % block_size:
        return None
    grid = slots.view(-1, block_size)
    if not torch.equal(grid - grid[:, :1], torch.arange(block_size).expand_as(grid)):
        return None
    return grid[:, 0] // block_size


def block_slots(blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """The slots of ``blocks``, in order."""
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()


def _stack_layers(pairs) -> Pair:
    """Per-layer (keys, values) pairs stacked into keys and values with a leading layer axis."""
    keys, values = zip(*pairs)
    return torch.stack(keys), torch.stack(values)


_BITS = {2: torch.int16, 4: torch.int32}


def _as_bits(x: torch.Tensor) -> np.ndarray:
    """A numpy view of ``x``'s elements as integers of the same width (any strides)."""
    width = _BITS.get(x.element_size())
    if width is None:
        raise ConnectorError(
            f"KV elements of {x.dtype} are not supported by the CPU packing kernels"
        )
    return x.view(width).numpy()


def vec_packing_offsets(block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``vec``/``vec16`` packing written out: K transposed, then V row-major."""
    tokens = torch.arange(block_size)[:, None]
    dims = torch.arange(head_dim)[None, :]
    return dims * block_size + tokens, block_size * head_dim + tokens * head_dim + dims


def probe_cpu_packing(
    isa: str, block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learn the CPU kernel's packing for ``isa`` by running it on position-encoded K/V.

    Returns ``(key_offsets, value_offsets)``, each ``[block_size, head_dim]`` int64. Raises
    ``ConnectorError`` if the kernel is unavailable or its packing is not a permutation of
    one (block, head) run.
    """
    try:
        from vllm import _custom_ops as ops
    except ImportError as exc:  # pragma: no cover - vLLM is a hard dependency of the connector
        raise ConnectorError(f"vLLM's CPU kernels cannot be imported: {exc}") from exc

    run = 2 * block_size * head_dim
    logical = torch.arange(block_size * head_dim).view(block_size, 1, head_dim)  # [T, H=1, D]
    digits = max(1, math.ceil(math.log(block_size * head_dim, _DIGIT_BASE)))
    key_pos = torch.zeros(run, dtype=torch.int64)
    is_key = None
    for digit in range(digits):
        code = (logical // _DIGIT_BASE**digit) % _DIGIT_BASE
        cache = torch.full((1, 1, block_size, 2 * head_dim), -1.0, dtype=dtype)
        key_cache, value_cache = cache.view(1, 1, 2 * block_size, head_dim).chunk(2, dim=2)
        try:
            ops.cpu_attn_reshape_and_cache(
                code.to(dtype),
                (code + _DIGIT_BASE).to(dtype),
                key_cache,
                value_cache,
                torch.arange(block_size, dtype=torch.int64),
                isa,
            )
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            raise ConnectorError(
                f"vLLM's CPU kernel rejects isa={isa!r}, head_dim={head_dim}, {dtype}: {exc}"
            ) from exc
        written = cache.view(run).to(torch.int64)
        if (written < 0).any():
            raise ConnectorError(
                f"CPU KV packing for isa={isa!r} leaves cache positions unwritten; "
                "unsupported layout"
            )
        digit_is_key = written < _DIGIT_BASE
        if is_key is None:
            is_key = digit_is_key
        elif not torch.equal(is_key, digit_is_key):
            raise ConnectorError(
                f"CPU KV packing for isa={isa!r} is not a fixed permutation; unsupported layout"
            )
        key_pos += (written % _DIGIT_BASE) * _DIGIT_BASE**digit
    assert is_key is not None
    offsets = []
    for mask in (is_key, ~is_key):
        positions = torch.nonzero(mask).flatten()
        ids = key_pos[positions]
        if positions.numel() != block_size * head_dim or not torch.equal(
            torch.sort(ids).values, torch.arange(ids.numel())
        ):
            raise ConnectorError(
                f"CPU KV packing for isa={isa!r} is not a permutation of one block; "
                "unsupported layout"
            )
        table = torch.empty(block_size * head_dim, dtype=torch.int64)
        table[ids] = positions
        offsets.append(table.view(block_size, head_dim))
    return offsets[0], offsets[1]


def layout_for_layer(layer: Any, cache: torch.Tensor) -> PagedLayout:
    """The layout of one attention layer's cache, or ``ConnectorError`` if unsupported.

    ``layer`` is vLLM's ``Attention`` module for that layer (it carries the backend, the
    KV dtype and, on CPU, the kernel ISA).
    """
    backend_cls = getattr(layer, "attn_backend", None)
    backend = backend_cls.get_name() if backend_cls is not None else type(layer).__name__
    kv_dtype = getattr(layer, "kv_cache_dtype", "auto")
    if kv_dtype not in ("auto", "bfloat16", "float16", "float32", "half", "float"):
        raise ConnectorError(
            f"KV cache dtype {kv_dtype!r} is not supported by the cachegen connector "
            "(it carries scales it does not translate); run vLLM with kv_cache_dtype='auto'"
        )
    if cache.dim() != 4 or cache.shape[-1] % 2:
        raise ConnectorError(
            f"{backend}: unexpected KV cache shape {tuple(cache.shape)} "
            "(MLA and other packed caches are unsupported)"
        )
    _, num_kv_heads, block_size, content = cache.shape
    head_dim = content // 2
    if backend in SPLIT_BACKENDS:
        return SplitLayout(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if backend == CPU_BACKEND:
        isa = getattr(layer, "isa", None)
        if isa is None:
            raise ConnectorError(
                "CPU attention layer has no kernel ISA set; cannot tell its KV packing"
            )
        key_offsets, value_offsets = probe_cpu_packing(isa, block_size, head_dim, cache.dtype)
        return CpuPackedLayout(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            key_offsets=key_offsets,
            value_offsets=value_offsets,
            isa=isa,
        )
    supported = ", ".join(sorted(SPLIT_BACKENDS | {CPU_BACKEND}))
    raise ConnectorError(
        f"attention backend {backend} is not supported by the cachegen connector "
        f"(supported: {supported}); "
        "choose one of those with VLLM_ATTENTION_BACKEND or attention_backend=..."
    )
