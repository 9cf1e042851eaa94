"""Helpers shared by the test modules and the micro-benchmarks (``from tests.support import``;
``pythonpath`` in pyproject.toml puts the repository on ``sys.path``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cachegen.constants import CHUNK_TOKENS
from cachegen.cpu import engine_dtype
from cachegen_lab.redis_cluster import free_cluster_port  # noqa: F401 (the tests' name for it)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
DOCS = REPO / "docs"
CHUNK = CHUNK_TOKENS  # two of vLLM's 128-token CPU blocks
ENGINE_DTYPE = engine_dtype()  # what every test engine runs in: float32 where bf16 is emulated

# Where .ci/run installs each tool from (Debian package names).
PACKAGES = {"redis-server": "redis-server", "redis-cli": "redis-server", "openssl": "openssl"}
PACKAGES |= {"chromium": "chromium", "tc": "iproute2", "ip": "iproute2"}


def require_tool(binary: str) -> str:
    """The path of ``binary``; fails (never skips) without it: .ci/run and `make test` install
    every tool the tests need."""
    path = shutil.which(binary)
    if path is None:
        package = PACKAGES.get(binary, binary)
        pytest.fail(f"{binary} is not installed: run `apt-get install -y {package}` (.ci/run does)")
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def private_file(path: Path, text: str) -> Path:
    """``path``, written with ``text`` and readable by its owner only (mode 600): how a
    secret or a password is handed to a server."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


@contextlib.contextmanager
def configured_redis(directory: Path, *conf: str):
    """A redis-server configured by ``conf`` lines (a password too: a config file keeps it off
    the command line); yields its port (the TLS port with TLS)."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    tls = any(line.startswith("tls-cert-file") for line in conf)
    lines = ["bind 127.0.0.1", 'save ""', "appendonly no", f"dir {directory}"]
    lines += [f"port 0\ntls-port {port}" if tls else f"port {port}", *conf]
    config = private_file(directory / "redis.conf", "\n".join(lines) + "\n")
    proc = subprocess.Popen(
        [require_tool("redis-server"), str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"redis-server did not start with {config}") from None
                time.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def require_cpu_kernel(isa: str, dtype, block_size: int = 32, head_dim: int = 64) -> None:
    """Skip unless vLLM's CPU cache-writing kernel for ``isa`` runs here: its ``amx`` variant
    needs AMX (vLLM picks it only where the CPU has it), so elsewhere the connector never meets
    that packing, and the ``vec``/``vec16`` packings are still checked against the kernel."""
    from cachegen.connector.errors import ConnectorError
    from cachegen.connector.layouts import probe_cpu_packing

    try:
        probe_cpu_packing(isa, block_size, head_dim, dtype)
    except ConnectorError as exc:
        pytest.skip(
            f"this CPU lacks the instructions of vLLM's {isa} kernel (AMX for 'amx'); the vec "
            f"and vec16 packings are still checked here ({exc})"
        )


def connector_engine(spec, store: str, **options):
    """A ConnectorEngine (the lab's vLLM engine with the connector) on ``store`` with this
    suite's defaults: CHUNK-token chunks and 2,048 positions."""
    from cachegen_lab.bench.engine import ConnectorEngine

    options.setdefault("chunk_tokens", CHUNK)
    options.setdefault("max_model_len", 2048)
    return ConnectorEngine(spec, store=store, **options)


def generate_with_params(engine, ids: list[int], params: dict, max_tokens: int = 12):
    """The greedy answer and the connector's report of a request to ``engine`` (a
    ConnectorEngine) that loads and does not save, with ``params`` as its further
    ``kv_transfer_params`` (ConnectorEngine.run always names a mode)."""
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"load": True, "save": False, **params}},
    )
    out = engine.llm.generate([{"prompt_token_ids": ids}], sampling, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.kv_transfer_params["cachegen"]


def connector_transport(spec, tmp_path, **extra):
    """The connector's ChunkTransport for ``spec`` on a directory store under ``tmp_path``
    (no engine), with CHUNK-token chunks and ``extra`` connector options; its loads read the
    store directly, or over the link a request's ``LabRequestOptions`` name (the lab's
    connector's sources)."""
    from cachegen.connector.transport import ChunkTransport
    from cachegen_lab.connector.links import EmulatedLinks
    from cachegen_lab.connector.options import lab_config

    config, shaper = lab_config(
        {"store": (tmp_path / "store").as_uri(), "chunk_tokens": CHUNK, **extra}
    )
    return ChunkTransport(config, spec, spec.identity(), lambda store: EmulatedLinks(store, shaper))


def corrupt_raw_chunk(engine, store_dir: Path, ids: list[int], index: int) -> None:
    """Flip a byte in the middle of every stored layer record of raw chunk ``index`` of
    ``ids`` in the directory store at ``store_dir``."""
    key = engine.transport.keys("raw", ids)[index]
    files = sorted(store_dir.rglob(f"*{key.split('/')[1]}*/L0*"))
    assert files, f"chunk {index} is not in the store"
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


def empty_cache_env(tmp_path: Path, secret: str) -> dict[str, str]:
    """The environment of a consumer process on a machine with an empty cache root (under
    ``tmp_path``) that holds the store's secret and nothing else."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "CACHEGEN_CACHE_DIR": str(tmp_path / "empty-cache"),
        "CACHEGEN_STORE_SECRET": secret,
    }
