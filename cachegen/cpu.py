"""What the host CPU computes fast: the dtype a vLLM engine on this machine should run in.

vLLM's CPU build runs bf16 models with bf16 GEMMs. Where the CPU has bf16 instructions
(AVX512-BF16, AMX-BF16) that is the fastest choice; where it has none (AVX2-only CPUs, AVX-512
without its bf16 extension) oneDNN refuses the bf16 linear, vLLM falls back to an emulated one
that is several times slower than float32, and float32 is the dtype to serve in
(docs/connector.md, "CPUs without bf16 instructions"). The connector moves KV in the engine's
own dtype, so both work; a store shared by engines of both dtypes decodes into either.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
DTYPE_ENV = "CACHEGEN_ENGINE_DTYPE"  # overrides the choice (bfloat16, float32, auto, ...)


@functools.cache
def cpu_fields(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where it does not exist)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the end of the first processor's block
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's feature flags (empty where /proc/cpuinfo does not exist)."""
    return frozenset(cpu_fields(cpuinfo).get("flags", "").split())


def native_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic instructions (else bf16 GEMMs are emulated)."""
    return bool(BF16_FLAGS & (cpu_flags() if flags is None else flags))


def engine_dtype(flags: frozenset[str] | None = None) -> str:
    """The dtype a CPU vLLM engine should run in here: ``$CACHEGEN_ENGINE_DTYPE`` if set, else
    bfloat16 with bf16 instructions and float32 without them."""
    chosen = os.environ.get(DTYPE_ENV)
    if chosen:
        return chosen
    return "bfloat16" if native_bf16(flags) else "float32"
