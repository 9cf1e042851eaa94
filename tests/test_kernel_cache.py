"""The kernel cache: numba keeps cachegen's compiled kernels in the user cache keyed by their
source, so a second checkout of the same source (another clone, another path) loads them
instead of compiling, and a changed kernel source is compiled again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cachegen import kernel_cache

LOCATORS = "cachegen.kernel_cache.SourceHashLocator,InTreeCacheLocator"
PROBE = """
import json, numpy as np
from cachegen.connector import packing_kernels as k
dst = np.zeros((3, 4), np.int16)
k._copy(dst, np.arange(12, dtype=np.int16).reshape(3, 4))
print(json.dumps({"file": k.__file__, "sum": int(dst.sum()),
                  "hits": sum(k._copy.stats.cache_hits.values()),
                  "misses": sum(k._copy.stats.cache_misses.values())}))
"""


def _probe(checkout: Path, cache: Path) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": str(checkout),
        "CACHEGEN_CACHE_DIR": str(cache),
        "NUMBA_CACHE_LOCATOR_CLASSES": LOCATORS,
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, cwd=checkout, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _checkout(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    shutil.copytree(
        kernel_cache.PACKAGE, root / "cachegen", ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def test_a_second_checkout_loads_the_kernels_the_first_compiled(tmp_path):
    cache = tmp_path / "cache"
    first, second = _checkout(tmp_path, "a"), _checkout(tmp_path, "b")
    compiled = _probe(first, cache)
    assert compiled["file"].startswith(str(first)) and compiled["sum"] == 66
    assert (compiled["hits"], compiled["misses"]) == (0, 1)
    (stamp_dir,) = (cache / "kernels").iterdir()
    assert stamp_dir.name == kernel_cache.kernel_sources_digest()[:16]
    assert list((stamp_dir / "connector_packing_kernels").glob("packing_kernels._copy-*.nbi"))

    loaded = _probe(second, cache)
    assert loaded["file"].startswith(str(second)) and loaded["sum"] == 66
    assert (loaded["hits"], loaded["misses"]) == (1, 0)
    assert not list(second.rglob("*.nbi"))  # nothing beside the source


def test_a_changed_kernel_source_is_compiled_again(tmp_path):
    cache = tmp_path / "cache"
    first, edited = _checkout(tmp_path, "a"), _checkout(tmp_path, "b")
    _probe(first, cache)
    rans = edited / "cachegen" / "codec" / "coding" / "rans.py"  # not the probe's kernel file
    rans.write_text(rans.read_text() + "\n# edited\n")
    recompiled = _probe(edited, cache)
    assert (recompiled["hits"], recompiled["misses"]) == (0, 1)
    assert len(list((cache / "kernels").iterdir())) == 2
