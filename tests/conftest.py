"""Shared fixtures: models (built once into the user cache) and a real redis-server."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from cachegen import models


@pytest.fixture
def isolated_profiles(tmp_path, monkeypatch):
    """An empty profile directory and no tables in memory."""
    from cachegen.codec import tables

    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "profiles"))
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real redis-server on 127.0.0.1 that tests may stop and restart."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(
                "redis-server is not installed: run `apt-get install -y redis-server` "
                "(.ci/run does)"
            )
        self.binary = binary
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

    def stop(self) -> None:
        if self.proc is not None:
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
    if redis_server.proc is None:
        redis_server.start()
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url
