"""Start a fleet per configuration, drive it with a workload at each link rate, record
every request.

Per configuration, one after another: a fresh store, ``servers`` vLLM OpenAI-compatible
servers started together (the connector's ones on that one store, LMCache's on the bench's
Redis), then one run per link rate (``bandwidths``; one run, with no rate, for a
configuration without the connector): every request of the workload through the router
(``drive``), then the servers stopped. Each run's requests carry their own ``cache_salt``,
so a later run of the same servers reuses nothing of an earlier one, neither from vLLM's
prefix cache nor from the store. A configuration that fails (a server that does not start, a
failed warm-up) ends the bench: the document keeps the runs done before it and records the
failure. Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from cachegen.errors import CacheGenError, InputError
from cachegen.modes import RECOMPUTE
from cachegen.store.secret_files import inline_password_error
from cachegen_lab.bench.links import link_label
from cachegen_lab.fleet import census, client, configs, lmcache, summary
from cachegen_lab.fleet.drive import Driver, Run, Sending, Stop, warm_up
from cachegen_lab.fleet.router import ROUND_ROBIN, Router
from cachegen_lab.fleet.workloads import Workload

if TYPE_CHECKING:  # imported where used: it loads torch, and `cachegen --help` should not
    from cachegen_lab.bench.openai_server import OpenAIServer

MIN_MODEL_LEN = 1024
CPU_BLOCK_TOKENS = 128  # a KV cache block of vLLM's CPU build
SERVERS = 2
MAX_TOKENS = 16  # greedy output tokens per request
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE of each server
LOCAL_CLUSTER = "local-cluster"
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


def progress(message: str) -> None:
    print(f"fleet-bench: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def fresh_store(base: str | None, config_name: str, run_id: str):
    """``(store URL, connector extra)`` of a store no earlier configuration wrote: a new
    temporary directory (removed afterwards) without ``base``; a new subdirectory of a
    ``file://`` ``base`` (kept); a Redis or Redis Cluster ``base`` shared, its keys scoped by
    a new ``tenant``."""
    if base is None:
        with tempfile.TemporaryDirectory(prefix="cachegen-fleet-") as tmp:
            yield Path(tmp).as_uri(), {}
    elif store_scheme(base) == "file":
        path = Path(urlparse(base).path) / f"{run_id}-{config_name}"
        path.mkdir(parents=True, exist_ok=False)
        yield path.as_uri(), {}
    else:
        yield base, {"tenant": f"fleet-{run_id}-{config_name}"}


def store_scheme(base: str) -> str:
    """The scheme of a store URL the fleet shares: ``file`` or one of ``REDIS_SCHEMES``;
    any other is refused, and so is a Redis password inline (the servers' command lines and
    logs would show it)."""
    refusal = inline_password_error(
        base, "--store", "it would be on the command line and in the log of every server"
    )
    if refusal is not None:
        raise InputError(str(refusal))
    scheme = urlparse(base).scheme
    if scheme != "file" and scheme not in REDIS_SCHEMES:
        raise InputError(
            f"--store {base!r}: use a file://, redis://, rediss:// or redis+cluster:// URL, "
            f"or {LOCAL_CLUSTER}"
        )
    return scheme


@contextlib.contextmanager
def shared_store(store: str | None):
    """The base store URL of the whole bench: ``store`` itself, or for ``local-cluster`` the
    URL of a Redis Cluster started for the bench (six local nodes, stopped afterwards)."""
    if store != LOCAL_CLUSTER:
        yield store
        return
    from cachegen_lab.redis_cluster import LocalRedisCluster

    progress("starting a local Redis Cluster (3 masters, 3 replicas)")
    with LocalRedisCluster() as cluster:
        yield cluster.url()


def core_shares(count: int) -> list[dict[str, str]]:
    """Per server, the environment that binds vLLM's CPU threads to its own share of this
    machine's cores (``VLLM_CPU_OMP_THREADS_BIND``), as servers on their own machines would
    have: left alone (vLLM binds every server to the same cores) when there are fewer cores
    than servers. The CUDA build ignores it."""
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // count
    if share == 0:
        return [{} for _ in range(count)]
    return [
        {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores[i * share : (i + 1) * share]))}
        for i in range(count)
    ]


def start_fleet(
    stack: contextlib.ExitStack,
    model: str,
    config: configs.Config,
    count: int,
    *,
    store: str | None,
    store_extra: dict[str, Any],
    max_model_len: int,
    env: dict[str, str],
    server_args: Sequence[str],
    log_dir: Path | None,
) -> list[OpenAIServer]:
    """``count`` servers of ``config``, started together, each with vLLM's ``server_args``;
    ``stack`` stops them."""
    from cachegen_lab.bench.openai_server import OpenAIServer

    servers = []
    for i, cores in enumerate(core_shares(count)):
        log = None if log_dir is None else log_dir / f"{config.name}-server{i}.log"
        server = OpenAIServer(
            model,
            mode=config.mode,
            store=store if config.connector else None,
            connector_extra={**config.connector_extra, **store_extra} if config.connector else {},
            max_model_len=max_model_len,
            log_path=log,
            prefix_caching=config.prefix_caching,
            links=True,  # its requests name the link their loads go over
            env={**env, **cores, **config.server_env(store)},
            server_args=[*server_args, *config.server_args()],
        )
        stack.callback(server.close)
        servers.append(server)
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda s: s.start(), servers))
    return servers


@dataclass(frozen=True)
class Bench:
    """What every configuration of one bench shares."""

    model: str
    work: Workload
    servers: int
    router: str
    sending: Sending
    bandwidths: tuple[float | None, ...]
    max_model_len: int
    store: str | None
    run_id: str
    env: dict[str, str]
    server_args: tuple[str, ...]
    log_dir: Path | None
    stop: Stop | None


def server_args(kv_cache_blocks: int | None) -> tuple[str, ...]:
    """vLLM's options of every server: its KV cache held to ``kv_cache_blocks`` blocks
    (``--num-gpu-blocks-override``; the CPU build honours it too) when given."""
    if kv_cache_blocks is None:
        return ()
    return ("--num-gpu-blocks-override", str(kv_cache_blocks))


def run_one(bench: Bench, fleet: list, run: Run, store: str | None) -> dict[str, Any]:
    """One run on a started fleet: its summary, the servers it stopped, its records and, for a
    fleet with the connector on ``store``, what its requests wrote there (the warm-up's
    entries left out)."""
    progress(f"{run.label}: {len(bench.work.requests)} requests, {bench.router}")
    driver = Driver(
        fleet,
        bench.work,
        Router(bench.router, bench.servers, bench.work),
        run,
        bench.sending,
        bench.stop,
    )
    asyncio.run(warm_up(fleet, bench.work, bench.sending, run))
    before = None if store is None else census.entries(store)
    records = asyncio.run(driver.records())
    result = summary.summarize(records, bench.servers, connector=run.connector)
    progress(f"{run.label}: {result['errors']} errors, {result['failovers']} failovers")
    wrote = None
    if before is not None:
        wrote = census.written(store, before)
        progress(
            f"{run.label}: the store gained {wrote['entries']} entries, "
            f"{wrote['payload_bytes']} bytes; {wrote['unreadable']} unreadable"
        )
    return {"summary": result, "stops": driver.stops, "records": records, "store": wrote}


def config_store(bench: Bench, config: configs.Config):
    """``(store URL, connector extra)`` the configuration's servers share: a fresh store for
    our connector's, the bench's Redis itself for LMCache's (its runs' request tags keep
    them apart), none otherwise."""
    if config.connector:
        return fresh_store(bench.store, config.name, bench.run_id)
    return contextlib.nullcontext((bench.store if config.lmcache else None, {}))


def run_config(bench: Bench, config: configs.Config) -> Iterator[dict[str, Any]]:
    """Every run of one configuration, each as it ends, on fresh servers and a fresh store."""
    rates = bench.bandwidths if config.connector else (None,)
    with config_store(bench, config) as (url, store_extra), contextlib.ExitStack() as stack:
        progress(f"{config.name}: starting {bench.servers} servers")
        fleet = start_fleet(
            stack,
            bench.model,
            config,
            bench.servers,
            store=url,
            store_extra=store_extra,
            max_model_len=bench.max_model_len,
            env=bench.env,
            server_args=bench.server_args,
            log_dir=bench.log_dir,
        )
        for rate in rates:
            salt = f"fleet-{bench.run_id}-{config.name}-{link_label(rate)}"
            run = Run(config.name, rate, salt, config.connector, config.lmcache)
            setup = {
                **config.describe(),
                "store": url,
                "tenant": store_extra.get("tenant"),
                "cache_salt": salt,
            }
            entry = {"config": config.name, "bandwidth_mbps": rate, "setup": setup}
            ours = url if config.connector else None  # a census reads our chunks, not LMCache's
            yield {**entry, **run_one(bench, fleet, run, ours)}


def measure(
    bench: Bench, config_names: Sequence[str], slo_ms: float
) -> tuple[list[dict[str, Any]], dict[str, str] | None]:
    """The runs of the configurations, in order, and the failure that ended them early
    (``{"config", "error"}``; None when every configuration ran): the runs done before a
    failure are kept."""
    runs: list[dict[str, Any]] = []
    for name in config_names:
        try:
            for run in run_config(bench, configs.config(name, bench.model, slo_ms)):
                runs.append(run)
        except CacheGenError as exc:
            progress(f"{name} failed; {len(runs)} runs done before it are kept")
            return runs, {"config": name, "error": str(exc)}
    return runs, None


def fleet_bench(
    model: str,
    work: Workload,
    config_names: Sequence[str],
    *,
    servers: int = SERVERS,
    router: str = ROUND_ROBIN,
    concurrency: int | None = None,
    max_tokens: int = MAX_TOKENS,
    api: str = client.RESPONSES,
    ignore_eos: bool = False,
    bandwidths: Sequence[float | None] = (None,),
    store: str | None = None,
    slo_ms: float = configs.SLO_MS,
    stop: Stop | None = None,
    kv_cache_gib: int = KV_CACHE_GIB,
    kv_cache_blocks: int | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Run ``work`` on a fleet per configuration, one after another, at every link rate of
    ``bandwidths`` (None: no rate limit): the versioned document, its ``failure`` set when a
    configuration failed (the runs before it kept). Each server has ``kv_cache_gib`` GiB for
    its KV cache (``VLLM_CPU_KVCACHE_SPACE``), of which it uses ``kv_cache_blocks`` blocks
    when given (None: all)."""
    concurrency = servers if concurrency is None else concurrency
    _check(servers, max_tokens, concurrency, bandwidths, stop, len(work.requests))
    max_model_len = max(MIN_MODEL_LEN, work.prompt_tokens_bound + max_tokens)
    _check_server(store, kv_cache_gib, kv_cache_blocks, max_model_len)
    lmcache.check(config_names, store)
    bench = Bench(
        model,
        work,
        servers,
        router,
        Sending(concurrency, max_tokens, api, ignore_eos),
        tuple(bandwidths),
        max_model_len,
        None,
        uuid.uuid4().hex[:8],
        {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)},
        server_args(kv_cache_blocks),
        log_dir,
        stop,
    )
    with shared_store(store) as base:
        runs, failure = measure(dataclasses.replace(bench, store=base), config_names, slo_ms)
    summary.compare_answers(runs, RECOMPUTE)
    settings = {
        "model": model,
        "workload": work.name,
        "workload_settings": work.settings,
        "seed": work.seed,
        "requests": len(work.requests),
        "servers": servers,
        "router": router,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "api": api,
        "ignore_eos": ignore_eos,
        "bandwidths_mbps": list(bandwidths),
        "store": store,
        "slo_ms": slo_ms,
        "stop": None if stop is None else {"server": stop.server, "after": stop.after},
        "kv_cache_gib": kv_cache_gib,
        "kv_cache_blocks": kv_cache_blocks,
    }
    return summary.document(settings, runs, failure)


def _check(servers, max_tokens, concurrency, bandwidths, stop, requests) -> None:
    if servers < 1 or max_tokens < 2 or concurrency < 1:
        raise InputError(
            "--servers and --concurrency must be at least 1 and --max-tokens at least 2"
        )
    if not bandwidths or any(b is not None and b <= 0 for b in bandwidths):
        raise InputError("--bandwidth-mbps: give positive rates in Mbit/s or unlimited")
    if stop is None:
        return
    if servers < 2 or not 0 <= stop.server < servers or stop.after < 1:
        raise InputError(
            "--stop-server needs at least two servers and names one of them (0 to servers-1); "
            "--stop-after at least 1"
        )
    if len(bandwidths) > 1:
        raise InputError("--stop-server runs at one link rate: give one --bandwidth-mbps")
    if stop.after >= requests:
        raise InputError(
            f"--stop-after {stop.after}: a run has {requests} requests, so the server would "
            f"never be stopped; give at most {requests - 1}"
        )


def _check_server(store, kv_cache_gib, kv_cache_blocks, max_model_len) -> None:
    if store not in (None, LOCAL_CLUSTER):
        store_scheme(store)
    if kv_cache_gib < 1:
        raise InputError("--kv-cache-gib must be at least 1")
    # vLLM keeps one block back and refuses to start unless the rest hold a whole request.
    least = -(-max_model_len // CPU_BLOCK_TOKENS) + 1
    if kv_cache_blocks is not None and kv_cache_blocks < least:
        raise InputError(
            f"--kv-cache-blocks {kv_cache_blocks}: the servers' longest request, "
            f"{max_model_len} tokens (the workload's longest prompt and --max-tokens), needs "
            f"{least - 1} blocks of {CPU_BLOCK_TOKENS} tokens and vLLM keeps one more; give at "
            f"least {least}"
        )
