"""docs/guide/serve.md, run as written: the blocks its source marks ``<!-- run: NAME -->``
(prepare the model, start vLLM's OpenAI-compatible server with the connector, send the same
long prompt twice, read the metrics and the store) run in that order, on a free port and a
fresh store directory given through the page's own ``$PORT`` and ``$STORE``. The second request
must load the stored prefix. The server runs in its own process group, stopped at the end
whatever happens."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support import DOCS, free_port

PAGE = DOCS / "guide" / "serve.md"
RUN_BLOCK = re.compile(r"<!-- run: (\w+) -->\n```(\w+)\n(.*?)\n```", re.DOTALL)
STEPS = ("prepare", "server", "requests", "operate")
PREPARE_TIMEOUT_S = 900  # profiles and kernels exist once built: then seconds
READY_TIMEOUT_S = 600
REQUESTS_TIMEOUT_S = 900
OPERATE_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
# What the Makefile sets: numba finds cachegen's kernels compiled by `make models` in the user
# cache (cachegen/kernel_cache.py) instead of compiling them again beside this checkout.
KERNEL_LOCATORS = (
    "cachegen.kernel_cache.SourceHashLocator,UserProvidedCacheLocator,"
    "InTreeCacheLocator,UserWideCacheLocator"
)


def run_blocks() -> dict[str, tuple[str, str]]:
    """The page's marked blocks: name -> (language, code)."""
    found = RUN_BLOCK.findall(PAGE.read_text())
    blocks = {name: (language, code) for name, language, code in found}
    assert [name for name, _, _ in found] == list(STEPS), "the page's run markers changed"
    return blocks


def page_env(port: int, store: Path) -> dict[str, str]:
    """A reader's environment: this one without the Makefile's in-process engine switch (the
    page runs vLLM's default, multiprocess engine), with the page's variables, and with this
    interpreter's scripts (`python`, `cachegen`) first on PATH."""
    env = dict(os.environ)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PORT"] = str(port)
    env["STORE"] = str(store)
    env.setdefault("NUMBA_CACHE_LOCATOR_CLASSES", KERNEL_LOCATORS)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start(block: tuple[str, str], env: dict[str, str], **streams) -> subprocess.Popen:
    """A sh or python block as a process leading its own process group."""
    language, code = block
    assert language in ("sh", "python"), language
    shell = ["bash", "-eo", "pipefail", "-c", code]
    return subprocess.Popen(
        shell if language == "sh" else [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # so that stop() ends whatever the block started
        **streams,
    )


def run(block: tuple[str, str], env: dict[str, str], timeout_s: float) -> str:
    """Run a block to its end; its stdout, or a failure with its output."""
    proc = start(block, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"{block[1]}\ndid not end within {timeout_s} s")
    assert proc.returncode == 0, f"{block[1]}\nexited {proc.returncode}:\n{out}{err}"
    return out


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    """Until the page's readiness check, /health, answers 200."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{log_tail(log)}")
        with contextlib.suppress(urllib.error.URLError, OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                if answer.status == 200:
                    return
        if time.monotonic() > deadline:
            pytest.fail(f"the server was not ready in {READY_TIMEOUT_S} s:\n{log_tail(log)}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to a block's process group (the shell, the server, its engine core), then
    SIGKILL to whatever is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the shell, the group's leader
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=STOP_TIMEOUT_S)


def reports(stdout: str) -> dict[str, dict]:
    """The connector's reports the requests block prints, one line per request."""
    found = {}
    for line in stdout.splitlines():
        name, _, report = line.partition(" ")
        if name in ("first", "second"):
            found[name] = json.loads(report)
    return found


def test_the_serving_guide_runs_as_written_and_the_repeat_loads_the_stored_prefix(tmp_path):
    blocks = run_blocks()
    port, store, log = free_port(), tmp_path / "chunks", tmp_path / "server.log"
    env = page_env(port, store)

    run(blocks["prepare"], env, PREPARE_TIMEOUT_S)

    with open(log, "wb") as out:
        server = start(blocks["server"], env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(server, port, log)
        printed = run(blocks["requests"], env, REQUESTS_TIMEOUT_S)
        print(printed)
        first, second = reports(printed)["first"], reports(printed)["second"]
        assert "error" not in first and first["save_chunks"] > 0, first
        assert "error" not in second and "load_error" not in second, second
        assert second["loaded_tokens"] > 0, second

        operated = run(blocks["operate"], env, OPERATE_TIMEOUT_S)
        print(operated)
        assert re.search(r"^vllm:cachegen_lookups_total\{", operated, re.MULTILINE), operated
        chunks = re.search(r"^chunks: (\d+)$", operated, re.MULTILINE)
        assert chunks and int(chunks.group(1)) >= first["save_chunks"], operated
    except BaseException:
        print(f"server log:\n{log_tail(log)}")
        raise
    finally:
        stop(server)
    assert server.returncode is not None
