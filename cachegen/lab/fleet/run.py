"""Start a fleet per configuration, drive it with a workload at each link rate, record
every request.

Per configuration, one after another: a fresh store, ``servers`` vLLM OpenAI-compatible
servers started together (the connector's ones on that one store), then one run per link rate
(``bandwidths``; one run, with no rate, for a configuration without the connector): every
request of the workload through the router (``drive``), then the servers stopped. Each run's
requests carry their own ``cache_salt``, so a later run of the same servers reuses nothing of
an earlier one, neither from vLLM's prefix cache nor from the store. Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import tempfile
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from cachegen.errors import InputError
from cachegen.lab.bench.links import link_label
from cachegen.lab.fleet import client, configs, summary
from cachegen.lab.fleet.drive import Driver, Run, Sending, Stop, warm_up
from cachegen.lab.fleet.router import ROUND_ROBIN, Router
from cachegen.lab.fleet.workloads import Workload
from cachegen.modes import RECOMPUTE

if TYPE_CHECKING:  # imported where used: it loads torch, and `cachegen --help` should not
    from cachegen.lab.bench.openai_server import OpenAIServer

MIN_MODEL_LEN = 1024
LOCAL_CLUSTER = "local-cluster"
REDIS_SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster")


def progress(message: str) -> None:
    print(f"fleet-bench: {message}", file=sys.stderr, flush=True)


def shown(url: str | None) -> str | None:
    """``url`` as the document records it: a password replaced by ``***``."""
    if url is None:
        return None
    parts = urlparse(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    return parts._replace(
        netloc=f"{user}***@{parts.hostname}:{parts.port or ''}".rstrip(":")
    ).geturl()


@contextlib.contextmanager
def fresh_store(base: str | None, config_name: str, run_id: str):
    """``(store URL, connector extra)`` of a store no earlier configuration wrote: a new
    temporary directory (removed afterwards) without ``base``; a new subdirectory of a
    ``file://`` ``base`` (kept); a Redis or Redis Cluster ``base`` shared, its keys scoped by
    a new ``tenant``."""
    if base is None:
        with tempfile.TemporaryDirectory(prefix="cachegen-fleet-") as tmp:
            yield Path(tmp).as_uri(), {}
        return
    scheme = urlparse(base).scheme
    if scheme == "file":
        path = Path(urlparse(base).path) / f"{run_id}-{config_name}"
        path.mkdir(parents=True, exist_ok=False)
        yield path.as_uri(), {}
    elif scheme in REDIS_SCHEMES:
        yield base, {"tenant": f"fleet-{run_id}-{config_name}"}
    else:
        raise InputError(
            f"--store {base!r}: use a file://, redis://, rediss:// or redis+cluster:// URL, "
            f"or {LOCAL_CLUSTER}"
        )


@contextlib.contextmanager
def shared_store(store: str | None):
    """The base store URL of the whole bench: ``store`` itself, or for ``local-cluster`` the
    URL of a Redis Cluster started for the bench (six local nodes, stopped afterwards)."""
    if store != LOCAL_CLUSTER:
        yield store
        return
    from cachegen.lab.redis_cluster import LocalRedisCluster

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
    log_dir: Path | None,
) -> list[OpenAIServer]:
    """``count`` servers of ``config``, started together; ``stack`` stops them."""
    from cachegen.lab.bench.openai_server import OpenAIServer

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
            env={**env, **cores},
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
    store: str | None
    run_id: str
    env: dict[str, str]
    log_dir: Path | None
    stop: Stop | None


def run_one(bench: Bench, fleet: list, run: Run) -> dict[str, Any]:
    """One run on a started fleet: its summary, the servers it stopped and its records."""
    label = f"{run.config} at {link_label(run.bandwidth_mbps)}" if run.connector else run.config
    progress(f"{label}: {len(bench.work.requests)} requests, {bench.router}")
    driver = Driver(
        fleet,
        bench.work,
        Router(bench.router, bench.servers, bench.work),
        run,
        bench.sending,
        bench.stop,
    )
    asyncio.run(warm_up(fleet, bench.work, bench.sending, run))
    records = asyncio.run(driver.records())
    result = summary.summarize(records, bench.servers, connector=run.connector)
    progress(f"{label}: {result['errors']} errors, {result['failovers']} failovers")
    return {"summary": result, "stops": driver.stops, "records": records}


def run_config(bench: Bench, config: configs.Config) -> list[dict[str, Any]]:
    """Every run of one configuration, on fresh servers and a fresh store."""
    work = bench.work
    max_model_len = max(MIN_MODEL_LEN, work.prompt_tokens_bound + bench.sending.max_tokens)
    no_store = contextlib.nullcontext((None, {}))
    stores = fresh_store(bench.store, config.name, bench.run_id) if config.connector else no_store
    rates = bench.bandwidths if config.connector else (None,)
    runs = []
    with stores as (url, store_extra), contextlib.ExitStack() as stack:
        progress(f"{config.name}: starting {bench.servers} servers")
        fleet = start_fleet(
            stack,
            bench.model,
            config,
            bench.servers,
            store=url,
            store_extra=store_extra,
            max_model_len=max_model_len,
            env=bench.env,
            log_dir=bench.log_dir,
        )
        for rate in rates:
            salt = f"fleet-{bench.run_id}-{config.name}-{link_label(rate)}"
            run = Run(config.name, rate, salt, config.connector)
            setup = {**config.describe(), "store": shown(url), "cache_salt": salt}
            entry = {"config": config.name, "bandwidth_mbps": rate, "setup": setup}
            runs.append({**entry, **run_one(bench, fleet, run)})
    return runs


def fleet_bench(
    model: str,
    work: Workload,
    config_names: Sequence[str],
    *,
    servers: int = 2,
    router: str = ROUND_ROBIN,
    concurrency: int | None = None,
    max_tokens: int = 8,
    api: str = client.RESPONSES,
    ignore_eos: bool = False,
    bandwidths: Sequence[float | None] = (None,),
    store: str | None = None,
    slo_ms: float = configs.SLO_MS,
    stop: Stop | None = None,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Run ``work`` on a fleet per configuration, one after another, at every link rate of
    ``bandwidths`` (None: no rate limit): the versioned document."""
    concurrency = servers if concurrency is None else concurrency
    _check(servers, max_tokens, concurrency, bandwidths, stop)
    bench = Bench(
        model,
        work,
        servers,
        router,
        Sending(concurrency, max_tokens, api, ignore_eos),
        tuple(bandwidths),
        None,
        uuid.uuid4().hex[:8],
        dict(env or {}),
        log_dir,
        stop,
    )
    with shared_store(store) as base:
        bench = dataclasses.replace(bench, store=base)
        runs = [
            run
            for name in config_names
            for run in run_config(bench, configs.config(name, model, slo_ms))
        ]
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
        "store": LOCAL_CLUSTER if store == LOCAL_CLUSTER else shown(store),
        "slo_ms": slo_ms,
        "stop": None if stop is None else {"server": stop.server, "after": stop.after},
    }
    return summary.document(settings, runs)


def _check(servers, max_tokens, concurrency, bandwidths, stop) -> None:
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
