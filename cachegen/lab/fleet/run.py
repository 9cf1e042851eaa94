"""Start a fleet per configuration, drive it with a workload, record every request.

Per configuration, one after another: a fresh store, ``servers`` vLLM OpenAI-compatible
servers started together (the connector's ones on that one store), every request of the
workload sent through the router with at most ``concurrency`` in flight (asyncio, one client
per server), then the servers stopped. A request waits for the request whose answer its chat
ends with (multi-round QA's closed loop); a failed request's answer is empty text. Progress goes
to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from cachegen.errors import InputError
from cachegen.lab.fleet import client, configs, summary
from cachegen.lab.fleet.router import ROUND_ROBIN, Router
from cachegen.lab.fleet.workloads import Workload

if TYPE_CHECKING:  # imported where used: it loads torch, and `cachegen --help` should not
    from cachegen.lab.bench.openai_server import OpenAIServer

REQUEST_TIMEOUT_S = 1800.0
MIN_MODEL_LEN = 1024


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
    ``file://`` ``base`` (kept); a Redis ``base`` shared, its keys scoped by a new ``tenant``."""
    if base is None:
        with tempfile.TemporaryDirectory(prefix="cachegen-fleet-") as tmp:
            yield Path(tmp).as_uri(), {}
        return
    scheme = urlparse(base).scheme
    if scheme == "file":
        path = Path(urlparse(base).path) / f"{run_id}-{config_name}"
        path.mkdir(parents=True, exist_ok=False)
        yield path.as_uri(), {}
    elif scheme in ("redis", "rediss"):
        yield base, {"tenant": f"fleet-{run_id}-{config_name}"}
    else:
        raise InputError(f"--store {base!r}: use a file://, redis:// or rediss:// URL")


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
    for i in range(count):
        log = None if log_dir is None else log_dir / f"{config.name}-server{i}.log"
        server = OpenAIServer(
            model,
            mode=config.mode,
            store=store if config.connector else None,
            connector_extra={**config.connector_extra, **store_extra} if config.connector else {},
            max_model_len=max_model_len,
            log_path=log,
            prefix_caching=config.prefix_caching,
            env=env,
        )
        stack.callback(server.close)
        servers.append(server)
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda s: s.start(), servers))
    return servers


async def drive(
    servers: Sequence[OpenAIServer],
    work: Workload,
    router: Router,
    *,
    config_name: str,
    concurrency: int,
    max_tokens: int,
    api: str,
    ignore_eos: bool = False,
) -> list[dict[str, Any]]:
    """Every request of ``work``, in order, at most ``concurrency`` in flight; its record."""
    clients = [s.async_client(timeout=REQUEST_TIMEOUT_S) for s in servers]
    loop = asyncio.get_running_loop()
    answered = {r.index: loop.create_future() for r in work.requests}
    turns: dict[int, list[dict[str, str]]] = {}  # per request: its chat after the system message
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(request) -> dict[str, Any]:
        history: list[dict[str, str]] = []
        if request.after is not None:
            await answered[request.after]
            history = turns[request.after]
        index = router.server(request)
        async with gate:
            answer = await client.send(
                clients[index],
                servers[index].model,
                request.messages(history),
                max_tokens,
                api,
                ignore_eos,
            )
        turns[request.index] = [
            *history,
            {"role": "user", "content": request.user},
            {"role": "assistant", "content": answer.text},
        ]
        answered[request.index].set_result(None)
        return summary.record(config_name, work.name, request, index, answer, start)

    try:
        return list(await asyncio.gather(*(one(r) for r in work.requests)))
    finally:
        for c in clients:
            await c.close()


def run_config(
    model: str,
    config: configs.Config,
    work: Workload,
    *,
    servers: int,
    router: str,
    concurrency: int,
    max_tokens: int,
    api: str,
    ignore_eos: bool,
    store: str | None,
    run_id: str,
    env: dict[str, str],
    log_dir: Path | None,
) -> dict[str, Any]:
    """One configuration on fresh servers and a fresh store: its setup, summary and records."""
    max_model_len = max(MIN_MODEL_LEN, work.prompt_tokens_bound + max_tokens)
    no_store = contextlib.nullcontext((None, {}))
    stores = fresh_store(store, config.name, run_id) if config.connector else no_store
    with stores as (url, store_extra):
        with contextlib.ExitStack() as stack:
            progress(f"{config.name}: starting {servers} servers")
            fleet = start_fleet(
                stack,
                model,
                config,
                servers,
                store=url,
                store_extra=store_extra,
                max_model_len=max_model_len,
                env=env,
                log_dir=log_dir,
            )
            progress(f"{config.name}: {len(work.requests)} requests, {router}")
            records = asyncio.run(
                drive(
                    fleet,
                    work,
                    Router(router, servers, work),
                    config_name=config.name,
                    concurrency=concurrency,
                    max_tokens=max_tokens,
                    api=api,
                    ignore_eos=ignore_eos,
                )
            )
    result = summary.summarize(records, servers, connector=config.connector)
    progress(f"{config.name}: {result['errors']} errors")
    setup = {**config.describe(), "store": shown(url)}
    return {"config": config.name, "setup": setup, "summary": result, "records": records}


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
    store: str | None = None,
    slo_ms: float = configs.SLO_MS,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
) -> dict[str, Any]:
    """Run ``work`` on a fleet per configuration, one after another: the versioned document."""
    if servers < 1 or max_tokens < 2:
        raise InputError("--servers must be at least 1 and --max-tokens at least 2")
    concurrency = servers if concurrency is None else concurrency
    if concurrency < 1:
        raise InputError("--concurrency must be at least 1")
    chosen = [configs.config(name, slo_ms) for name in config_names]
    run_id = uuid.uuid4().hex[:8]
    results = [
        run_config(
            model,
            config,
            work,
            servers=servers,
            router=router,
            concurrency=concurrency,
            max_tokens=max_tokens,
            api=api,
            ignore_eos=ignore_eos,
            store=store,
            run_id=run_id,
            env=dict(env or {}),
            log_dir=log_dir,
        )
        for config in chosen
    ]
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
        "store": shown(store),
        "slo_ms": slo_ms,
    }
    return summary.document(settings, results)
