"""One vLLM engine in its own process, measuring one request at a time.

The sweep runs every engine in a fresh child process (``python -m
cachegen_lab.bench.engine_process``) so engines never overlap, a crash costs one engine's
measurements only, and vLLM's memory goes back to the system when it is done. Inside, the
engine is the connector's measurement entry point, ``cachegen_lab.bench.engine.ConnectorEngine``
(vLLM with the CacheGenConnector, every mode chosen per request), or, when no KV mode is
wanted or the connector cannot start, a plain vLLM ``LLM`` that can only recompute from text.
``EngineSession`` is the parent's side:

    with EngineSession("smollm2-135m", max_model_len=4200, connector={...}) as engine:
        engine.store_prefix(prompt)                        # prefill once, wait until stored
        row = engine.run(prompt, mode="int8", bandwidth_mbps=100, max_tokens=16)  # a RequestRow

The child reads one JSON request per line on stdin and answers one JSON object per line on
file descriptor ``--report-fd`` (vLLM's own logging stays on stdout/stderr): first
``{"schema": "cachegen-engine-protocol", "version", "event": "ready", "startup_s"}`` (the
parent refuses another protocol), then per request ``{"event": "result", ...}`` with the
fields of the request's ``cachegen_lab.rows.RequestRow``,
``{"event": "request-error", "message"}`` when one request failed (the engine goes on), or
``{"event": "error", "message"}`` when the engine itself failed.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

from cachegen.cpu import engine_dtype
from cachegen.errors import InputError
from cachegen.fileio import check_version, versioned
from cachegen.modes import RECOMPUTE
from cachegen_lab.rows import RequestRow

GPU_MEMORY_UTILIZATION = 0.3  # on CPU: the share of RAM vLLM may plan with (docs/connector.md)
STARTUP_TIMEOUT_S = 600.0
PROTOCOL_SCHEMA = "cachegen-engine-protocol"
PROTOCOL_VERSION = 2  # 2: a run request carries max_loss_pct


class EngineError(RuntimeError):
    """The engine failed to start, died or timed out. The sweep records the affected modes
    as missing with this message; it is not a user error."""


class RequestFailed(EngineError):
    """One request failed inside a healthy engine; the session can go on."""


class EngineSession:
    """The parent's handle on one engine process."""

    def __init__(
        self,
        model: str,
        max_model_len: int,
        *,
        connector: dict | None = None,
        log=None,
        request_timeout_s: float = 900.0,
    ) -> None:
        self.job = {"model": model, "max_model_len": int(max_model_len), "connector": connector}
        self.log = log
        self.request_timeout_s = request_timeout_s
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._events: int | None = None
        self._buffer = b""

    def __enter__(self) -> EngineSession:
        read_fd, write_fd = os.pipe()
        # The child imports the same cachegen as this process, installed or not.
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cachegen_lab.bench.engine_process",
                "--report-fd",
                str(write_fd),
            ],
            stdin=subprocess.PIPE,
            stdout=self.log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if self.log else subprocess.DEVNULL,
            pass_fds=(write_fd,),
            env=env,
        )
        os.close(write_fd)
        self._events = read_fd
        try:
            self._send(self.job)
            ready = check_ready(self._receive(STARTUP_TIMEOUT_S))
        except BaseException:
            self.close()
            raise
        self.startup_s = ready.get("startup_s")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(
        self,
        prompt_token_ids: list[int],
        *,
        mode: str = RECOMPUTE,
        level: int | None = None,
        bandwidth_mbps: float | None = None,
        slo_ms: float | None = None,
        max_loss_pct: float | None = None,
        max_tokens: int = 16,
    ) -> RequestRow:
        """One request; ``mode`` is ``recompute`` or a connector mode (``adaptive`` takes
        ``slo_ms`` or ``max_loss_pct``)."""
        event = self._call(
            {
                "op": "run",
                "prompt_token_ids": list(prompt_token_ids),
                "mode": mode,
                "level": level,
                "bandwidth_mbps": bandwidth_mbps,
                "slo_ms": slo_ms,
                "max_loss_pct": max_loss_pct,
                "max_tokens": int(max_tokens),
            }
        )
        event.pop("event")
        return RequestRow(**event)

    def store_prefix(self, prompt_token_ids: list[int]) -> dict:
        """Prefill from text with saving on, returning once every save mode is stored."""
        return self._call({"op": "store_prefix", "prompt_token_ids": list(prompt_token_ids)})

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()  # end of requests: the child exits
            self.proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            self.proc.kill()
            self.proc.wait()
        if self._events is not None:
            os.close(self._events)
            self._events = None
        self.proc = None

    def _call(self, request: dict) -> dict:
        self._send(request)
        return self._receive(self.request_timeout_s)

    def _send(self, obj: dict) -> None:
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise EngineError(self._death_note()) from None

    def _receive(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.proc.kill()  # a hung engine must not hang the sweep
                raise EngineError(
                    f"the engine gave no answer within {timeout_s:.0f} s and was stopped"
                )
            ready, _, _ = select.select([self._events], [], [], min(left, 1.0))
            if ready:
                data = os.read(self._events, 1 << 16)
                if not data:
                    raise EngineError(self._death_note())
                self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        event = json.loads(line)
        if event["event"] == "request-error":
            raise RequestFailed(event["message"])
        if event["event"] == "error":
            raise EngineError(event["message"])
        return event

    def _death_note(self) -> str:
        code = self.proc.wait(timeout=30) if self.proc else None
        return f"the engine process exited (status {code}) without answering" + (
            "" if self.log else "; rerun with --verbose to see vLLM's log"
        )


def check_ready(event: dict) -> dict:
    """The child's ready event, if it speaks this module's protocol (else ``EngineError``)."""
    try:
        return check_version(
            event, PROTOCOL_SCHEMA, (PROTOCOL_VERSION,), "the engine process's ready event"
        )
    except InputError as exc:  # another cachegen answered: its rows cannot be trusted here
        raise EngineError(str(exc)) from None


# ---- the child process ---------------------------------------------------------------------


class _PlainEngine:
    """vLLM without a connector: recompute from text only."""

    def __init__(self, model: str, max_model_len: int) -> None:
        from vllm import LLM

        from cachegen.models import resolve

        self.model = model
        self.llm = LLM(
            model=str(resolve(model).path),
            max_model_len=max_model_len,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            enforce_eager=True,
            enable_prefix_caching=False,
            disable_log_stats=False,
            seed=0,
            dtype=engine_dtype(),
        )

    def run(self, prompt_token_ids, *, mode, max_tokens, **_ignored) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from cachegen_lab.bench.engine import Measurement

        if mode != RECOMPUTE:
            raise ValueError(f"mode {mode} needs the CacheGenConnector, which did not start")
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        begin = time.perf_counter()
        out = self.llm.generate(
            [TokensPrompt(prompt_token_ids=list(prompt_token_ids))], params, use_tqdm=False
        )[0]
        e2e = time.perf_counter() - begin
        ttft = float(out.metrics.first_token_latency) if out.metrics is not None else None
        tokens = list(out.outputs[0].token_ids)
        # generate() shows neither the first token's wall time nor the output rate after it
        m = Measurement(
            mode=mode,
            level=None,
            bandwidth_mbps=None,
            slo_ms=None,
            prompt_tokens=len(prompt_token_ids),
            ttft_s=ttft,
            ttft_wall_s=None,
            e2e_s=e2e,
            output_tokens=len(tokens),
            output_tokens_per_s=None,
            cached_tokens=int(out.num_cached_tokens or 0),
            token_ids=tokens,
        )
        return RequestRow.from_measurement(m, self.model).to_dict()


class _Connected:
    """The connector's measurement entry point, answering with rows."""

    def __init__(self, model: str, max_model_len: int, connector: dict) -> None:
        from cachegen_lab.bench.engine import ConnectorEngine

        self.model = model
        self.engine = ConnectorEngine(model, max_model_len=max_model_len, **connector)

    def run(self, prompt_token_ids, **request) -> dict:
        m = self.engine.run(prompt_token_ids, **request)
        return RequestRow.from_measurement(m, self.model).to_dict()

    def store_prefix(self, prompt_token_ids) -> dict:
        self.engine.store_prefix(prompt_token_ids)
        return {}


def _serve(engine, request: dict) -> dict:
    op = request.pop("op")
    if op == "run":
        return engine.run(request.pop("prompt_token_ids"), **request)
    if op == "store_prefix":
        return engine.store_prefix(request["prompt_token_ids"])
    raise ValueError(f"unknown operation {op!r}")


def main() -> int:
    os.environ.setdefault(
        "VLLM_ENABLE_V1_MULTIPROCESSING", "0"
    )  # in-process engine: starts much faster than the multiprocess one (docs/connector.md)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report-fd", type=int, required=True)
    args = parser.parse_args()
    report = os.fdopen(args.report_fd, "w", buffering=1)

    def emit(obj: dict) -> None:
        report.write(json.dumps(obj) + "\n")

    status = 0
    try:
        job = json.loads(sys.stdin.readline())
        begin = time.perf_counter()
        if job.get("connector") is not None:
            engine = _Connected(job["model"], job["max_model_len"], job["connector"])
        else:
            engine = _PlainEngine(job["model"], job["max_model_len"])
        ready = {"event": "ready", "startup_s": time.perf_counter() - begin}
        emit(versioned(PROTOCOL_SCHEMA, PROTOCOL_VERSION, ready))
        for line in sys.stdin:
            try:
                emit({"event": "result", **_serve(engine, json.loads(line))})
            except Exception as exc:  # one failed request does not end the session
                emit({"event": "request-error", "message": f"{type(exc).__name__}: {exc}"})
    except Exception as exc:
        emit({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        status = 1
    report.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's teardown takes seconds and nothing of it is needed: the stores write
    # atomically, so leaving now cannot leave a half-written entry behind.
    os._exit(status)


if __name__ == "__main__":
    main()
