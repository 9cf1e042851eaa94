"""cachegen's codecs as a serde of LMCache's multiprocess L2 adapters (``cachegen[lmcache]``).

LMCache takes serdes from a registry filled in its server's process
(``lmcache.v1.distributed.serde.factory.register_serde_factory``); it discovers none by entry
point. So :func:`register` adds the type ``cachegen`` there, and ``python -m
cachegen.integrations.lmcache ARGS`` runs LMCache's command line (``lmcache ARGS``, e.g.
``server``) with it registered. An adapter then names it::

    {"type": "fs", "base_path": "/var/cache/kv",
     "serde": {"type": "cachegen", "model": "smollm2-135m"}}

See docs/guide/lmcache.md. Nothing here imports LMCache until it is called.
"""

from __future__ import annotations

from collections.abc import Sequence

SERDE_TYPE = "cachegen"
INSTALL = "pip install 'cachegen[lmcache]'"


def register() -> None:
    """Register the ``cachegen`` serde type with LMCache (again: no-op)."""
    try:
        from lmcache.v1.distributed.serde.factory import (
            get_registered_serde_types,
            register_serde_factory,
        )
    except ImportError as exc:
        raise ImportError(f"the cachegen serde needs LMCache: {INSTALL}") from exc
    from cachegen.integrations.lmcache.serde import make_processor

    if SERDE_TYPE not in get_registered_serde_types():
        register_serde_factory(SERDE_TYPE, make_processor)


def main(argv: Sequence[str] | None = None) -> None:
    """LMCache's command line with the ``cachegen`` serde registered."""
    register()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(argv)
