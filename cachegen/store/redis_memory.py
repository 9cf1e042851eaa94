"""What a Redis store's ``max_memory`` option means: a check of the server, never a setting.

A store never changes the server's configuration: the server may be shared with other
applications. Chunks are written with a TTL (``ttl_s``); the codec's tables, model files,
profile documents and adopted-profile pointers never get one. Under a ``maxmemory-policy``
that evicts only keys with a TTL (``volatile-lru``, ``volatile-lfu``, ``volatile-ttl``,
``volatile-random``), memory pressure then evicts chunks and never what chunks need to be
decoded. ``max_memory`` asks the store to check, when it opens, that the server is set up so:
``maxmemory`` set and at most ``max_memory``, such a policy, on every master of a cluster
(the client knows no replicas: give them the same settings, since a replica becomes a master
when its master fails), and ``ttl_s`` given. Anything else stops the opening with a
``StoreConfigError`` that names the settings to make.
"""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster

from cachegen.store.errors import StoreConfigError

SAFE_POLICIES = ("volatile-lru", "volatile-lfu", "volatile-ttl", "volatile-random")
_FIX = (
    "the store never changes server settings, so have the server set up with "
    "`maxmemory {max_memory}` and `maxmemory-policy volatile-lru` (redis.conf, or CONFIG SET "
    "by its operator), or open the store without max_memory"
)


def check_options(max_memory: int | None, ttl_s: int | None) -> None:
    """Refuse a ``max_memory`` that cannot work: not positive, or without ``ttl_s``."""
    if max_memory is None:
        return
    if max_memory <= 0:
        raise StoreConfigError(f"max_memory must be a positive size, got {max_memory}")
    if ttl_s is None:
        raise StoreConfigError(
            "max_memory needs ttl_s: a volatile-* maxmemory-policy evicts only keys with a "
            "TTL, and chunks get one only from ttl_s (the tables and profiles they need never "
            "do); add ?ttl_s=SECONDS, a long one if chunks should go only when memory runs out"
        )


def check_server(client, endpoint, max_memory: int) -> None:
    """Raise ``StoreConfigError`` unless every master ``client`` reaches (through
    ``endpoint``, a ``RedisEndpoint``) bounds its memory to at most ``max_memory`` and evicts
    only keys with a TTL. Reads the settings with CONFIG GET; sets nothing."""
    nodes = client.get_primaries() if isinstance(client, RedisCluster) else [None]
    for node in nodes:
        where = endpoint.label if node is None else f"{endpoint.label} (node {node.name})"
        with endpoint.errors(f"read the maxmemory settings of {where}"):
            try:
                found = _settings(client, node)
            except redis.exceptions.ResponseError as exc:  # CONFIG refused or renamed
                raise StoreConfigError(
                    f"max_memory: cannot read the maxmemory settings of redis at {where} "
                    f"({endpoint.redact(exc)}): allow the store's user CONFIG GET (ACL "
                    "+config|get), or open the store without max_memory once the server evicts "
                    "only keys with a TTL (maxmemory-policy volatile-lru)"
                ) from exc
        problem = _problem(found, max_memory)
        if problem is not None:
            fix = _FIX.format(max_memory=max_memory)
            raise StoreConfigError(f"max_memory: redis at {where} {problem}; {fix}")


def _settings(client, node) -> dict[str, str]:
    if node is None:
        return client.config_get("maxmemory*")
    return client.config_get("maxmemory*", target_nodes=node)


def _problem(found: dict[str, str], max_memory: int) -> str | None:
    """What is wrong with the server's ``maxmemory*`` settings ``found``, if anything."""
    policy = found.get("maxmemory-policy", "")
    limit = int(found.get("maxmemory", "0") or 0)
    if policy.startswith("allkeys-"):
        return (
            f"evicts with maxmemory-policy {policy}, which may evict the codec tables and "
            "profiles that its chunks need before the chunks"
        )
    if policy not in SAFE_POLICIES:
        return (
            f"has maxmemory-policy {policy or 'unknown'}, which evicts nothing and refuses "
            "writes once its memory is full"
        )
    if limit == 0:
        return "has no maxmemory, so nothing bounds its memory"
    if limit > max_memory:
        return f"has maxmemory {limit} bytes, more than max_memory {max_memory}"
    return None
