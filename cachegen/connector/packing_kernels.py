"""numba kernels moving whole blocks between logical K/V and vLLM's CPU ``vec`` packing.

Each (block, head) run of the packed cache holds the block's keys transposed
(``[head_dim, block_size]``) followed by its values row-major (``[block_size, head_dim]``);
see ``layouts.CpuPackedLayout``. One call moves the blocks of every layer without the GIL:
inside vLLM the engine thread holds the GIL between its steps, and a call per layer waited
for it 30 times per chunk.

Imported on first use, never at vLLM start-up: numba loads llvmlite, which vLLM 0.32's CPU
start-up does not tolerate (docs/connector.md, "Known issues").

Arrays are integer views of the KV elements (a copy moves bits, whatever the float type):
``runs_by_layer`` is a tuple with one ``[num_blocks, num_kv_heads, 2, block_size * head_dim]``
array per layer; ``keys``/``values`` are ``[layers, num_kv_heads, len(blocks) * block_size,
head_dim]`` (any strides).
"""

from __future__ import annotations

import numba


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _scatter_layer(runs, blocks, keys, values):
    heads, tokens, head_dim = keys.shape
    # From the tokens rather than the run length: LLVM then emits a faster loop.
    block_size = tokens // blocks.shape[0]
    for j in range(blocks.shape[0]):
        block = blocks[j]
        first = j * block_size
        for h in range(heads):
            key_run = runs[block, h, 0]
            value_run = runs[block, h, 1]
            for o in range(block_size):
                for d in range(head_dim):
                    value_run[o * head_dim + d] = values[h, first + o, d]
            # Written in order (reads strided): faster here than the reverse or tiled orders.
            for d in range(head_dim):
                for o in range(block_size):
                    key_run[d * block_size + o] = keys[h, first + o, d]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _gather_layer(runs, blocks, keys, values):
    heads, tokens, head_dim = keys.shape
    block_size = tokens // blocks.shape[0]
    for j in range(blocks.shape[0]):
        block = blocks[j]
        first = j * block_size
        for h in range(heads):
            key_run = runs[block, h, 0]
            value_run = runs[block, h, 1]
            for o in range(block_size):
                for d in range(head_dim):
                    values[h, first + o, d] = value_run[o * head_dim + d]
            for o in range(block_size):
                for d in range(head_dim):
                    keys[h, first + o, d] = key_run[d * block_size + o]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def scatter_vec_blocks(runs_by_layer, blocks, keys, values):
    for layer in range(len(runs_by_layer)):
        _scatter_layer(runs_by_layer[layer], blocks, keys[layer], values[layer])


@numba.njit(nogil=True, cache=True, boundscheck=False)
def gather_vec_blocks(runs_by_layer, blocks, keys, values):
    for layer in range(len(runs_by_layer)):
        _gather_layer(runs_by_layer[layer], blocks, keys[layer], values[layer])
