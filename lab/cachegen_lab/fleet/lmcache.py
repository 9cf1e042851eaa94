"""The ``lmcache`` configuration: every server runs vLLM with LMCache's own connector
(``LMCacheConnectorV1``), configured through LMCache's environment variables (it reads
``LMCACHE_*`` when no ``LMCACHE_CONFIG_FILE`` is set), the servers sharing the bench's Redis
through LMCache's ``redis://`` remote connector, chunks coded by LMCache's CacheGen serde.

LMCache 0.5.6's connector runs only on vLLM's CUDA build: on the CPU build it logs
``RuntimeError: No supported cpu connector found.`` and recomputes every prompt
(docs/connector/lmcache-on-cpu.md), so :func:`check` refuses it on a machine without CUDA.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from cachegen.errors import InputError
from cachegen.store.secret_files import named_password
from cachegen_lab.codecs.lmcache_peer import LMCACHE_CHUNK_TOKENS

LMCACHE = "lmcache"
TRANSFER = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
CHUNK_TOKENS = LMCACHE_CHUNK_TOKENS  # LMCache's default chunk_size, its CacheGen serde's
CPU_GIB = 5  # each server's LMCache CPU buffer (LMCache's default max_local_cpu_size)
SERDE = "cachegen"  # LMCache's own CacheGen (its valid serdes: naive, kivi, cachegen)
SCHEMES = ("redis", "rediss")  # LMCache's RedisConnector: redis-py's from_url
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
# LMCache keys a chunk by its tokens only, not vLLM's cache_salt: a request tag goes into the
# key, so that a run (or its warm-up) reuses nothing of another, as with our connector.
SALT_TAG = "lmcache.tag.cache_salt"
WHERE = (
    "run it on a GPU machine with vLLM's CUDA build and LMCache installed with its "
    "dependencies (third_party/lmcache/README.md)"
)


def settings() -> dict[str, str]:
    """LMCache's environment of every server but the store's URL (recorded in the setup)."""
    return {
        "LMCACHE_CHUNK_SIZE": str(CHUNK_TOKENS),
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": str(CPU_GIB),
        "LMCACHE_REMOTE_SERDE": SERDE,
    }


def server_args() -> tuple[str, ...]:
    return ("--kv-transfer-config", json.dumps(TRANSFER))


def environment(store: str) -> dict[str, str]:
    """LMCache's whole environment of a server sharing ``store`` (a ``redis://`` or
    ``rediss://`` URL of ours). A password the URL names by file or variable goes into
    ``LMCACHE_REMOTE_URL`` only, and LMCache's log is held to warnings, as its INFO lines
    echo that URL."""
    password = named_password(store)
    env = {**settings(), "LMCACHE_REMOTE_URL": remote_url(store, password)}
    if password is not None:
        env["LMCACHE_LOG_LEVEL"] = "WARNING"
    return env


def remote_url(store: str, password: str | None) -> str:
    """``store`` as redis-py takes it, with ``password``: user, password, host, port, database
    and TLS options; our store's own options (``ttl_s``, ``prefix``...) mean nothing to
    LMCache."""
    parts = urlsplit(store)
    user = quote(parts.username or "", safe="")
    auth = user if password is None else f"{user}:{quote(password, safe='')}"
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
    netloc = (f"{auth}@" if auth else "") + host + (f":{parts.port}" if parts.port else "")
    tls = [(k, v) for k, v in parse_qsl(parts.query) if k in TLS_OPTIONS]
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(tls), ""))


def cuda_present() -> bool:
    """The device check (a seam: the tests answer it without a GPU)."""
    import torch

    return torch.cuda.is_available()


def check(config_names: Sequence[str], store: str | None, cuda: bool | None = None) -> None:
    """Refuse ``lmcache`` among ``config_names`` where it cannot run, before any server
    starts: without CUDA (``cuda``; None: ask :func:`cuda_present`), without LMCache, or
    without a Redis ``store`` its servers can share."""
    if LMCACHE not in config_names:
        return
    if not (cuda_present() if cuda is None else cuda):
        raise InputError(
            "--configs lmcache: LMCache 0.5.6's connector needs vLLM's CUDA build, and this "
            "machine has no CUDA (on vLLM's CPU build it logs 'RuntimeError: No supported cpu "
            f"connector found.' and recomputes every prompt: docs/connector/lmcache-on-cpu.md); "
            f"{WHERE}, or leave lmcache out of --configs"
        )
    if importlib.util.find_spec("lmcache") is None:
        raise InputError(f"--configs lmcache: LMCache is not installed here; {WHERE}")
    if store is None or urlsplit(store).scheme not in SCHEMES:
        why = "none was given" if store is None else "it reads no other kind of store of ours"
        raise InputError(  # the URL is not echoed: it may hold a password inline
            "--configs lmcache: its servers share one store through LMCache's Redis connector: "
            f"give --store redis://HOST:PORT/DB or rediss://HOST:PORT/DB ({why})"
        )
    named_password(store)  # a password file or variable that does not answer fails here
