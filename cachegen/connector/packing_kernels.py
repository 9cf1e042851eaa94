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
def _copy(dst, src):
    # Written in order (reads strided): faster here than the reverse or tiled orders.
    for i in range(dst.shape[0]):
        for j in range(dst.shape[1]):
            dst[i, j] = src[i, j]


@numba.njit(nogil=True, cache=True, boundscheck=False)
def _move_layer(runs, blocks, keys, values, into_runs):
    """Copy one layer's blocks into the runs (``into_runs``) or out of them."""
    heads, tokens, head_dim = keys.shape
    # From the tokens rather than the run length: LLVM then emits a faster loop.
    block_size = tokens // blocks.shape[0]
    for j in range(blocks.shape[0]):
        first = j * block_size
        for h in range(heads):
            key_run = runs[blocks[j], h, 0].reshape(head_dim, block_size)  # K transposed
            value_run = runs[blocks[j], h, 1].reshape(block_size, head_dim)
            block_keys = keys[h, first : first + block_size]
            block_values = values[h, first : first + block_size]
            if into_runs:
                _copy(value_run, block_values)
                _copy(key_run, block_keys.T)
            else:
                _copy(block_values, value_run)
                _copy(block_keys, key_run.T)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def scatter_vec_blocks(runs_by_layer, blocks, keys, values):
    for layer in range(len(runs_by_layer)):
        _move_layer(runs_by_layer[layer], blocks, keys[layer], values[layer], True)


@numba.njit(nogil=True, cache=True, boundscheck=False)
def gather_vec_blocks(runs_by_layer, blocks, keys, values):
    for layer in range(len(runs_by_layer)):
        _move_layer(runs_by_layer[layer], blocks, keys[layer], values[layer], False)
