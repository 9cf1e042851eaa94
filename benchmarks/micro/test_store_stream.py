"""Store and streaming micro-benchmarks (pytest-benchmark; skipped by `--benchmark-skip`).

    .venv/bin/pytest benchmarks/micro/test_store_stream.py --benchmark-only

Targets checked here (docs/streaming.md): goodput within 5% of the configured rate at 100/500/1000
Mbit/s with both shapers, and pipelined load time at most 1.15 x max(transfer, decode) for
SmolLM2 at 4K tokens with the cachegen codec. Each test asserts its target and records the
measured numbers in ``extra_info`` (see the JSON from ``--benchmark-json``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from cachegen.store import open_store
from cachegen.stream import stream_load
from cachegen_lab.network import netns, open_link
from tests.support import free_port, require_tool

RATES = (100, 500, 1000)
CHUNK_BYTES = 1_000_000
PAYLOAD_S = 1.0  # seconds of traffic per measured load at the configured rate


@pytest.fixture(scope="module")
def synthetic_store(tmp_path_factory):
    store = open_store(tmp_path_factory.mktemp("bench-store").as_uri())
    n = int(max(RATES) * 1e6 / 8 * PAYLOAD_S / CHUNK_BYTES)
    keys = [f"bench/c{i:04d}" for i in range(n)]
    for k in keys:
        store.put(k, 0, os.urandom(CHUNK_BYTES))
    return store, keys


def _shaper_params():
    out = []
    for shaper in ("token-bucket", "netns"):
        marks = []
        if shaper == "netns" and netns.unavailable_reason():
            marks = [pytest.mark.skip(reason=netns.unavailable_reason())]
        out += [pytest.param(shaper, rate, marks=marks, id=f"{shaper}-{rate}") for rate in RATES]
    return out


@pytest.mark.parametrize("shaper,rate", _shaper_params())
def test_goodput(benchmark, synthetic_store, shaper, rate):
    store, keys = synthetic_store
    keys = keys[: max(8, int(rate * 1e6 / 8 * PAYLOAD_S / CHUNK_BYTES))]
    results = []

    def load():
        with open_link(store, bandwidth_mbps=rate, shaper=shaper) as link:
            results.append(stream_load(link.source, keys, len, lambda i, x: None, level=0))

    benchmark.pedantic(load, rounds=3, iterations=1)
    goodputs = [r.goodput_mbps for r in results]
    median = sorted(goodputs)[len(goodputs) // 2]
    benchmark.extra_info.update(
        {"goodput_mbps": goodputs, "bytes": results[0].bytes, "rate_mbps": rate}
    )
    assert abs(median / rate - 1) <= 0.05, (
        f"median goodput {median:.1f} Mbit/s vs {rate} configured"
    )


@pytest.fixture(scope="module")
def redis_url():
    binary = require_tool("redis-server")  # fails, not skips, as the tests do
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("backend", ["local", "redis"])
def test_store_put_get_1mb(benchmark, backend, tmp_path, request):
    url = tmp_path.as_uri() if backend == "local" else request.getfixturevalue("redis_url")
    store = open_store(url)
    blob = os.urandom(CHUNK_BYTES)

    def put_get():
        store.put("bench/x", 1, blob)
        return store.get("bench/x", 1)

    assert benchmark(put_get) == blob


@pytest.fixture(scope="module")
def smollm2_4k(tmp_path_factory):
    from cachegen import models
    from cachegen_lab.bench import stream_bench as bench

    store = open_store(tmp_path_factory.mktemp("smollm2-4k").as_uri())
    ids = bench.bench_tokens(models.resolve("smollm2-135m"), 4096)
    return store, bench.prepare(store, "smollm2-135m", "cachegen", ids, 256, [2])


@pytest.mark.parametrize("rate", RATES)
def test_pipelined_load_smollm2_4k(benchmark, smollm2_4k, rate):
    from cachegen_lab.bench import stream_bench as bench

    store, prep = smollm2_4k
    bench.warm_up(store, prep)
    runs = []

    def load():
        runs.append(
            bench.run_load(store, prep, shaper="token-bucket", bandwidth=rate, rtt_ms=0, level=2)[0]
        )

    benchmark.pedantic(load, rounds=3, iterations=1)
    ratios = sorted(r.load_s / max(r.transfer_s, r.decode_s) for r in runs)
    benchmark.extra_info.update(
        {
            "pipeline_ratio": ratios,
            "transfer_s": [r.transfer_s for r in runs],
            "decode_s": [r.decode_s for r in runs],
            "load_s": [r.load_s for r in runs],
            "bytes": runs[0].bytes,
        }
    )
    assert ratios[len(ratios) // 2] <= 1.15
