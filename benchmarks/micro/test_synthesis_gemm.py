"""The synthesis product of a tcq decode on its own, in three arithmetics side by side in one
run (pytest-benchmark; skipped by `--benchmark-skip`):

    .venv/bin/pytest benchmarks/micro/test_synthesis_gemm.py --benchmark-only

A tcq decode multiplies each frame's coefficients by the synthesis matrices, ``[tokens, kept]
@ [kept, channels]`` for every (layer, K/V) stream (``tcq_decode.TcqDecoder``). Here the
matrices are SmolLM2's at tcq level 24 (its shipped model file), four frames of 256 tokens:
the 11.8 M elements of ``test_transform_codec_speed.py``, for which 300 M elements/s allows
39 ms in all. The cases: ``float32`` (``torch.bmm``, what a CPU without bf16 instructions
runs), ``bf16`` (``torch.bmm``, emulated where the CPU lacks bf16 instructions) and ``int8``
(``torch._int_mm``, int8 x int8 -> int32, one stream at a time: torch has no batched integer
product), and ``int16``, the decoder's own integer kernel (``cachegen.codec.tcq.int_synthesis``:
int16 x int16 -> int32 with AVX2's ``vpmaddwd``, streams split over the codec's threads as a
decode runs it; skipped where it was not built or the CPU has no AVX2). The int16 kernel also
writes its rows as bf16 into the output's head layout, the pass the other arithmetics leave
to ``tcq_kernels.write_rows``: its time includes more work than theirs. The coefficients are
random small integers: the time does not depend on the values. Nothing is asserted about the
times.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cachegen.codec.coding.parallel import run_batches
from cachegen.codec.tcq import int_synthesis
from cachegen.codec.tcq.code import level_code
from cachegen.codec.tcq.int_synthesis import IntegerSynthesis
from cachegen.profiles import codec_for
from tests.support import CHUNK

LEVEL = 24
FRAMES = 4


@pytest.fixture(scope="module")
def synthesis() -> torch.Tensor:
    """SmolLM2's synthesis matrices at ``LEVEL`` for every layer, [streams, kept, channels],
    the kept rows padded with zeros to a multiple of 8 (``torch._int_mm``'s rule)."""
    tcq = codec_for("tcq", "smollm2-135m", chunk_tokens=CHUNK).tcq
    layers = tuple(range(len(tcq.rope_thetas)))
    matrices = level_code(tcq, LEVEL).stream_tables(tcq, layers).synthesis
    pad = -matrices.shape[1] % 8
    return torch.nn.functional.pad(matrices, (0, 0, 0, pad)).contiguous()


def _int8(matrices: torch.Tensor) -> torch.Tensor:
    """The matrices rounded to int8, one scale per stream and channel (the time's operand)."""
    scale = matrices.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(matrices / scale).to(torch.int8)


def _bf16_values(streams: int, channels: int) -> tuple[int_synthesis.Destination, np.ndarray]:
    """A bf16 output of ``CHUNK`` tokens for every stream, nothing turned, SmolLM2's head dim
    (the int16 kernel writes the output's head layout itself), and zero means."""
    head_dim = 64
    heads = channels // head_dim
    out = np.empty(streams * heads * CHUNK * head_dim, dtype=np.uint16)
    base = np.arange(streams, dtype=np.int64) * heads * CHUNK * head_dim
    angles = np.zeros((0, 0), dtype=np.float32)
    unturned = np.full(streams, -1, dtype=np.int64)
    to = int_synthesis.Destination(out, base, CHUNK, head_dim, angles, angles, unturned)
    return to, np.zeros((streams, channels), dtype=np.float32)


@pytest.mark.parametrize("arithmetic", ["float32", "bf16", "int8", "int16"])
def test_synthesis_product(benchmark, synthesis, arithmetic):
    streams, kept, channels = synthesis.shape
    generator = torch.Generator().manual_seed(0)
    symbols = torch.randint(-8, 9, (FRAMES, streams, CHUNK, kept), generator=generator)
    if arithmetic == "int16":
        if not int_synthesis.available():
            pytest.skip("the int16 kernel is not built here or the CPU has no AVX2")
        matrices = IntegerSynthesis.of(synthesis)
        frames = symbols.to(torch.int16).numpy()
        to, mean = _bf16_values(streams, channels)

        def product():
            for frame in frames:
                run_batches(int_synthesis.product(frame, matrices, mean, to), np.ones(streams))

    elif arithmetic == "int8":
        matrices, frames = _int8(synthesis), symbols.to(torch.int8)

        def product():
            for frame in frames:
                for s in range(streams):
                    torch._int_mm(frame[s], matrices[s])

    else:
        dtype = torch.float32 if arithmetic == "float32" else torch.bfloat16
        matrices, frames = synthesis.to(dtype), symbols.to(dtype)
        rows = torch.empty((streams, CHUNK, channels), dtype=dtype)

        def product():
            for frame in frames:
                torch.bmm(frame, matrices, out=rows)

    benchmark.extra_info["elements"] = FRAMES * streams * CHUNK * channels
    benchmark.extra_info["kept_rows"] = kept
    benchmark(product)
