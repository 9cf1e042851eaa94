"""Values that several layers must agree on, defined once."""

from __future__ import annotations

import os
from pathlib import Path

# Tokens per codec frame, stored chunk and connector load unit. Per-chunk scales depend on it,
# so the codec, the store keys and the connector must use the same value.
CHUNK_TOKENS = 256

# How a link's rate is enforced: a token bucket in the chunk server, the kernel's tc in a
# private network namespace (root), or nothing at all (the store is read directly).


def cache_root() -> Path:
    """Root of cachegen's user cache: ``$CACHEGEN_CACHE_DIR``, else ``$XDG_CACHE_HOME/cachegen``,
    else ``~/.cache/cachegen``. Models, profiles and the default chunk store live below it."""
    explicit = os.environ.get("CACHEGEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "cachegen"
