"""Where numba keeps cachegen's compiled kernels: the user cache, keyed by the kernels' source.

numba's own cache (``cache=True``) keys a compiled kernel by its source file's path and
modification time, so a fresh clone or a reinstall compiles every kernel again, which takes
minutes on two cores. ``SourceHashLocator`` keys the kernels of cachegen's files by the
SHA-256 of their source instead, and keeps them in ``cache_root()/kernels``: a machine
compiles a kernel once per version of its source, wherever the checkout is.

A kernel is compiled with the callees and global constants of other modules frozen in, so the
key covers every file of the package that uses numba and the cachegen modules those import;
a change to any of them recompiles them all.

numba takes it through its ``NUMBA_CACHE_LOCATOR_CLASSES`` setting, which the Makefile sets
(``KERNEL_CACHE_LOCATORS``: this locator first, numba's own after it for every other file).
Without the setting, numba's default (``__pycache__`` beside each file) applies.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path

from numba.core.caching import _CacheLocator

from cachegen.constants import cache_root

PACKAGE = Path(__file__).resolve().parent
_FIRST_PARTY_IMPORT = re.compile(
    r"^\s*from (cachegen(?:\.\w+)+) import \(?([\w\s,]+)", re.MULTILINE
)


def _module_file(module: str) -> Path | None:
    path = PACKAGE.parent.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def kernel_sources_digest() -> str:
    """SHA-256 over the package's files that use numba and the cachegen modules they import."""
    users = {p for p in PACKAGE.rglob("*.py") if "numba" in p.read_text(encoding="utf-8")}
    files = set(users)
    for path in users:
        for module, names in _FIRST_PARTY_IMPORT.findall(path.read_text(encoding="utf-8")):
            # the module, and any of its names that is a module itself (from a package)
            candidates = [module] + [f"{module}.{name}" for name in re.findall(r"\w+", names)]
            files.update(f for f in map(_module_file, candidates) if f is not None)
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


class SourceHashLocator(_CacheLocator):
    """numba's cache locator for cachegen's kernels (see the module)."""

    def __init__(self, py_func, py_file: Path) -> None:
        self._lineno = py_func.__code__.co_firstlineno
        self._stamp = kernel_sources_digest()
        relative = py_file.relative_to(PACKAGE).with_suffix("")
        self._path = cache_root() / "kernels" / self._stamp[:16] / "_".join(relative.parts)

    def get_cache_path(self) -> str:
        return str(self._path)

    def get_source_stamp(self) -> str:
        return self._stamp

    def get_disambiguator(self) -> str:
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        path = Path(py_file).resolve()
        if PACKAGE not in path.parents:
            return None  # not ours: numba's next locator takes it
        locator = cls(py_func, path)
        try:
            locator.ensure_cache_path()
        except OSError:
            return None
        return locator
