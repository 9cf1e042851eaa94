"""Shared fixtures: models (built once into the user cache), a real redis-server and a real
Redis Cluster (3 masters, 3 replicas)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cachegen import models
from cachegen_lab.redis_cluster import LocalRedisCluster
from tests.support import free_cluster_port, free_port, require_tool

# The suite runs as `pytest -n 2 --dist loadfile --no-loadscope-reorder` (Makefile): each file
# is one unit of work, handed out in this order, and the run ends when the last file ends. The
# files that start vLLM engines, servers or fits take longest on 2 cores, so they go first,
# longest first, and the many short files fill the tail (xdist's own reorder puts the files
# with most tests first, which left the fleet's single long test for last).
LONGEST_FIRST = (
    "tests/connector/test_gemma.py",
    "tests/connector/test_disagg.py",
    "tests/connector/test_adapters.py",
    "tests/connector/test_hma.py",
    "tests/connector/test_cluster.py",
    "tests/lab/fleet/test_fleet.py",
    "tests/connector/test_openai.py",
    "tests/connector/test_chaos.py",
    "tests/docs/test_guide_serve.py",
    "tests/connector/test_smollm2.py",
    "tests/connector/test_tensor_parallel.py",
    "tests/codec/test_codec.py",
    "tests/connector/test_vllm_load.py",
    "tests/lab/bench/test_quick.py",
    "tests/lab/connector/test_peer_engine.py",
    "tests/integrations/test_lmcache_serde.py",
    "tests/connector/test_store_faults.py",
    "tests/connector/test_head_shards.py",
    "tests/codec/test_shipped_tcq.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


@pytest.fixture
def isolated_profiles(tmp_path, monkeypatch):
    """An empty profile directory, no tables in memory, and no table provider but that
    directory: the stores of connector engines still alive in this session provide tables to
    every decoder of the process, and would find the ones a test removed."""
    from cachegen.codec.coding import tables

    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "profiles"))
    monkeypatch.setattr(tables, "_providers", [tables.LOCAL])
    tables.forget_cached_tables()
    yield tmp_path / "profiles"
    tables.forget_cached_tables()


@pytest.fixture(scope="session")
def smollm2() -> models.ModelSpec:
    return models.resolve("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3() -> models.ModelSpec:
    return models.resolve("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_llama() -> models.ModelSpec:
    return models.resolve("tiny-llama")


@pytest.fixture(scope="session")
def tiny_opt() -> models.ModelSpec:
    return models.resolve("tiny-opt")


@pytest.fixture(scope="session")
def tiny_qwen2() -> models.ModelSpec:
    return models.resolve("tiny-qwen2")


class RedisServer:
    """A real redis-server on 127.0.0.1 that tests may stop and restart."""

    def __init__(self) -> None:
        self.binary = require_tool("redis-server")
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        pytest.fail(f"redis-server did not start on port {self.port}")

    def fresh_url(self) -> str:
        """The URL of this server, started if a test stopped it, with every key deleted."""
        if self.proc is None:
            self.start()
        import redis

        redis.Redis.from_url(self.url).flushall()
        return self.url

    def pause(self) -> None:
        """SIGSTOP: connections stay open and nothing answers (a hung or partitioned server)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of a running redis-server, flushed before each test."""
    return redis_server.fresh_url()


# ---- a real Redis Cluster ------------------------------------------------------------------


def _require_redis_binaries() -> None:
    for binary in ("redis-server", "redis-cli"):
        require_tool(binary)


def _start_redis(args: list[str], port: int) -> subprocess.Popen:
    """Start redis-server with ``args`` and wait until it accepts connections on ``port``."""
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"redis-server did not start on port {port}") from None
            time.sleep(0.02)


class RedisCluster(LocalRedisCluster):
    """The lab's local cluster (six nodes) with the helpers of the failure tests: nodes may
    be killed, paused and restarted (``start_node``). A one-second node timeout makes
    failovers quick."""

    def __init__(
        self, root: Path, size: int = 6, password: str | None = None, query: str = ""
    ) -> None:
        super().__init__(size, password=password, root=root, query=query, node_timeout_ms=1000)

    def kill(self, port: int) -> None:
        """SIGKILL: no goodbye to the other nodes, as when a machine dies."""
        proc = self.procs[port]
        if proc is not None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            self.procs[port] = None

    def pause(self, port: int) -> None:
        """SIGSTOP: the node answers nothing (nor votes, nor fails over) until resumed."""
        self.procs[port].send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        self.procs[port].send_signal(signal.SIGCONT)

    def count_in_slot(self, port: int, slot: int) -> int:
        with contextlib.closing(self.client(port)) as c:
            return c.execute_command("CLUSTER COUNTKEYSINSLOT", slot)

    def master_of(self, name: str) -> int:
        """The port of the live master that holds the slot of the Redis key ``name``."""
        with contextlib.closing(self.client(self.alive()[0])) as c:
            slot = c.execute_command("CLUSTER KEYSLOT", name)
        return next(p for p in self.masters() if self.count_in_slot(p, slot))

    def wait_promoted(self, replica: int, timeout_s: float = 15.0) -> float:
        """Wait until ``replica`` has taken over its failed master's slots and the cluster is
        ok again on every live node; returns the seconds waited."""
        t0 = time.monotonic()
        while replica not in self.masters():
            assert time.monotonic() - t0 < timeout_s, f"{replica} was not promoted"
            time.sleep(0.05)
        self.wait_ok(timeout_s=max(0.0, timeout_s - (time.monotonic() - t0)))
        return time.monotonic() - t0

    def wait_replicated(self, master: int, timeout_s: float = 10.0) -> None:
        """Until the replica of ``master`` holds as many keys as it (replication is
        asynchronous: a master killed before its replica caught up would lose writes, which
        is not under test)."""
        replica = self.replica_of(master)
        deadline = time.monotonic() + timeout_s
        with (
            contextlib.closing(self.client(master)) as m,
            contextlib.closing(self.client(replica)) as r,
        ):
            while m.dbsize() != r.dbsize():
                assert time.monotonic() < deadline, "the replica did not catch up"
                time.sleep(0.05)

    def keys_per_master(self, pattern: str = "cachegen:*") -> dict[int, list[bytes]]:
        out = {}
        for port in self.masters():
            with contextlib.closing(self.client(port)) as c:
                out[port] = list(c.scan_iter(match=pattern, count=1000))
        return out

    def nodes(self) -> list[dict]:
        """The live view of ``CLUSTER NODES``: port, id, role, master id, slot count, ok."""
        cmd = [self._cli, "-p", str(self.alive()[0]), "cluster", "nodes"]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=10, check=True, env=self.cli_env()
        )
        text = done.stdout
        out = []
        for line in text.strip().splitlines():
            fields = line.split()
            node_id, addr, flags, master = fields[0], fields[1], fields[2], fields[3]
            slots = 0
            for spec in fields[8:]:
                if spec.startswith("["):
                    continue
                lo, _, hi = spec.partition("-")
                slots += int(hi or lo) - int(lo) + 1
            out.append(
                {
                    "id": node_id,
                    "port": int(addr.split("@")[0].rsplit(":", 1)[1]),
                    "master": "master" in flags,
                    "of": None if master == "-" else master,
                    "slots": slots,
                    "failed": "fail" in flags,
                }
            )
        return out

    def masters(self) -> list[int]:
        return sorted(
            n["port"] for n in self.nodes() if n["master"] and n["slots"] and not n["failed"]
        )

    def replica_of(self, master_port: int) -> int:
        nodes = self.nodes()
        mid = next(n["id"] for n in nodes if n["port"] == master_port)
        return next(n["port"] for n in nodes if n["of"] == mid)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """``redis_cluster(password=None, query="")``: a new real Redis Cluster (3 masters, 3
    replicas) on free loopback ports whose ``url()`` carries the store options ``query``,
    stopped at the end of the module that made it."""
    _require_redis_binaries()
    made: list[RedisCluster] = []

    def make(password: str | None = None, query: str = "") -> RedisCluster:
        cluster = RedisCluster(tmp_path_factory.mktemp("cluster"), password=password, query=query)
        made.append(cluster)
        cluster.start()
        return cluster

    try:
        yield make
    finally:
        for cluster in made:
            cluster.stop()


@pytest.fixture
def evicting_redis(tmp_path):
    """The port of a single redis-server (not a cluster) that evicts only keys with a TTL
    (volatile-ttl) once its maxmemory is set."""
    _require_redis_binaries()
    port = free_cluster_port()
    proc = _start_redis(
        [
            shutil.which("redis-server"),
            "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
            "--save", "", "--appendonly", "no", "--maxmemory-policy", "volatile-ttl",
        ],
        port,
    )  # fmt: skip
    try:
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
