"""TTFT and concurrency through vLLM's OpenAI-compatible server, with and without the cachegen
connector, driven by the real ``openai`` client (docs/connector.md, "The OpenAI-compatible
server"):

    cachegen serve-bench --modes recompute raw cachegen --json

Per mode one server is started (``recompute``: no connector; otherwise the connector with that
``mode`` and a fresh file store), prefix caching off, and measured twice:

``pair``
    a system document and question 1, streamed; question 2 over the same document is sent as
    soon as question 1's last token arrives; question 3 once the connector has stored the
    document's chunks. Time to first token of each (send to first content chunk).
``concurrency``
    ``clients`` concurrent clients each send ``requests`` streamed requests one after another,
    over ``documents`` shared documents (client *i* asks about document *i* mod ``documents``,
    a different question each time); each document is asked about and stored once before the
    clients start. Errors, p50/p95 TTFT, requests/s and output tokens/s over the wall time of
    the whole run, and how many answers equal those of the ``recompute`` server (greedy,
    temperature 0, the same ``max_tokens``).

Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from cachegen import workload
from cachegen.errors import InputError
from cachegen.fileio import versioned
from cachegen.models import EMBEDDED_DEFAULT
from cachegen.modes import RECOMPUTE

if TYPE_CHECKING:  # imported where used: it loads torch, and `cachegen --help` should not
    from cachegen_lab.bench.openai_server import OpenAIServer

SCHEMA = "cachegen-serve-bench"
VERSION = 1
MODES = (RECOMPUTE, "raw", "cachegen")
DEFAULT_MODEL = EMBEDDED_DEFAULT
CONTEXT_TOKENS = 3072
MAX_TOKENS = 32
CLIENTS = 8
REQUESTS_PER_CLIENT = 4
DOCUMENTS = 2
REQUEST_TIMEOUT_S = 1800.0


def progress(message: str) -> None:
    print(f"serve-bench: {message}", file=sys.stderr, flush=True)


def chat(document: str, question: int) -> list[dict[str, str]]:
    """A system document and the bench's question ``question`` about it."""
    return [
        {"role": "system", "content": document},
        {"role": "user", "content": workload.bench_question(question).strip()},
    ]


def documents(model: str, count: int, tokens: int) -> list[str]:
    """``count`` disjoint documents of about ``tokens`` tokens of held-out text."""
    from transformers import AutoTokenizer

    from cachegen.models import resolve
    from cachegen_lab.bench.prompts import contexts

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(model).path))
    return [tokenizer.decode(c.ids) for c in contexts(tokenizer, [tokens] * count)]


@dataclass
class Streamed:
    """One streamed chat completion; times in seconds from sending it."""

    ttft_s: float | None
    e2e_s: float
    output_tokens: int
    text: str
    error: str | None = None


async def stream_chat(
    client, model: str, messages: list[dict[str, str]], max_tokens: int
) -> Streamed:
    """Send one streamed, greedy chat completion and time its first and last content."""
    start = time.perf_counter()
    first = None
    parts: list[str] = []
    output_tokens = 0
    try:
        stream = await client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                output_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    if first is None:
                        first = time.perf_counter() - start
                    parts.append(choice.delta.content)
    except Exception as exc:  # the bench counts every failed request, whatever its kind
        return Streamed(first, time.perf_counter() - start, 0, "".join(parts), repr(exc))
    return Streamed(first, time.perf_counter() - start, output_tokens, "".join(parts))


def _percentile(values: Sequence[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[q - 1])


# ---- the two measurements ----------------------------------------------------------------------


async def pair(server: OpenAIServer, document: str, max_tokens: int) -> dict[str, Any]:
    """Question 1, question 2 right after its last token, question 3 after the store holds the
    document's chunks (on a server with the connector)."""
    client = server.async_client(timeout=REQUEST_TIMEOUT_S)
    try:
        q1 = await stream_chat(client, server.model, chat(document, 0), max_tokens)
        q2 = await stream_chat(client, server.model, chat(document, 1), max_tokens)
        if server.config is not None:
            await asyncio.to_thread(server.wait_stored, server.tokenize_chat(chat(document, 0)))
        q3 = await stream_chat(client, server.model, chat(document, 2), max_tokens)
    finally:
        await client.close()
    return {
        "mode": server.mode,
        "prompt_tokens": len(server.tokenize_chat(chat(document, 0))),
        "q1": asdict(q1),
        "q2": asdict(q2),
        "q3_after_save": asdict(q3),
    }


async def concurrency(
    server: OpenAIServer,
    docs: Sequence[str],
    *,
    clients: int,
    requests: int,
    max_tokens: int,
) -> dict[str, Any]:
    """``clients`` clients x ``requests`` streamed requests over the shared ``docs``."""
    first_question = 100  # apart from the questions the documents are primed with
    client = server.async_client(timeout=REQUEST_TIMEOUT_S)
    try:
        for document in docs:  # each document prefilled and stored once, untimed
            await stream_chat(client, server.model, chat(document, first_question - 1), 2)
            if server.config is not None:
                ids = server.tokenize_chat(chat(document, first_question - 1))
                await asyncio.to_thread(server.wait_stored, ids)

        async def one_client(i: int) -> list[dict[str, Any]]:
            rows = []
            for j in range(requests):
                doc, question = i % len(docs), first_question + i * requests + j
                result = await stream_chat(
                    client, server.model, chat(docs[doc], question), max_tokens
                )
                rows.append({"client": i, "document": doc, "question": question, **asdict(result)})
            return rows

        start = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(i) for i in range(clients)))
        wall_s = time.perf_counter() - start
    finally:
        await client.close()
    rows = [row for block in per_client for row in block]
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None and r["error"] is None]
    output_tokens = sum(r["output_tokens"] for r in rows)
    return {
        "mode": server.mode,
        "clients": clients,
        "requests_per_client": requests,
        "documents": len(docs),
        "requests": len(rows),
        "errors": sum(r["error"] is not None for r in rows),
        "wall_s": wall_s,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p95_s": _percentile(ttfts, 95),
        "requests_per_s": len(rows) / wall_s,
        "output_tokens_per_s": output_tokens / wall_s,
        "output_tokens": output_tokens,
        "answers_equal_recompute": None,
        "rows": rows,
    }


def _compare_answers(results: list[dict[str, Any]]) -> None:
    """Count, per run, the answers equal to the first ``recompute`` run's answer to the same
    document and question (further ``recompute`` runs show how much recomputing alone varies
    under concurrency)."""
    baseline = next((r for r in results if r["mode"] == RECOMPUTE), None)
    if baseline is None:
        return
    expected = {(r["document"], r["question"]): r["text"] for r in baseline["rows"]}
    for result in results:
        if result is baseline:
            continue
        result["answers_equal_recompute"] = sum(
            r["error"] is None and expected.get((r["document"], r["question"])) == r["text"]
            for r in result["rows"]
        )


# ---- the whole bench ---------------------------------------------------------------------------


def serve_bench(
    model: str = DEFAULT_MODEL,
    modes: Sequence[str] = MODES,
    *,
    context_tokens: int = CONTEXT_TOKENS,
    clients: int = CLIENTS,
    requests: int = REQUESTS_PER_CLIENT,
    documents_count: int = DOCUMENTS,
    max_tokens: int = MAX_TOKENS,
    recompute_runs: int = 1,
) -> dict[str, Any]:
    """Start one server per mode in turn and measure ``pair`` and ``concurrency`` on it; the
    ``recompute`` server's concurrent phase runs ``recompute_runs`` times (answers of later runs
    are compared with the first run's, like every other mode's)."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise InputError(f"modes {unknown} are not measured here; choose from {', '.join(MODES)}")
    if min(clients, requests, documents_count, recompute_runs) < 1:
        raise InputError(
            "--clients, --requests, --documents and --recompute-runs must be at least 1"
        )
    from cachegen_lab.bench.openai_server import OpenAIServer

    docs = documents(model, 1 + documents_count, context_tokens)
    pairs, runs = [], []
    for mode in modes:
        progress(f"starting the server (mode {mode})")
        with OpenAIServer(model, mode=mode, max_model_len=context_tokens + 512) as server:
            progress(f"mode {mode}: question 1, question 2 right after, question 3 after saving")
            pairs.append(asyncio.run(pair(server, docs[0], max_tokens)))
            for _ in range(recompute_runs if mode == RECOMPUTE else 1):
                progress(f"mode {mode}: {clients} clients x {requests} requests")
                runs.append(
                    asyncio.run(
                        concurrency(
                            server,
                            docs[1:],
                            clients=clients,
                            requests=requests,
                            max_tokens=max_tokens,
                        )
                    )
                )
                progress(f"mode {mode}: {runs[-1]['errors']} errors")
    _compare_answers(runs)
    return versioned(
        SCHEMA,
        VERSION,
        {
            "model": model,
            "context_tokens": context_tokens,
            "max_tokens": max_tokens,
            "pair": pairs,
            "concurrency": runs,
        },
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def markdown(result: dict[str, Any]) -> str:
    """The TTFT table and the concurrency table."""
    lines = [
        f"{result['model']}, documents of {result['context_tokens']} tokens, "
        f"{result['max_tokens']} greedy output tokens",
        "",
        "| mode | prompt tokens | q1 TTFT (ms) | q2 TTFT, right after q1 (ms) "
        "| q3 TTFT, after saving (ms) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for row in result["pair"]:
        lines.append(
            f"| {row['mode']} | {row['prompt_tokens']} | {_ms(row['q1']['ttft_s'])} "
            f"| {_ms(row['q2']['ttft_s'])} | {_ms(row['q3_after_save']['ttft_s'])} |"
        )
    lines += [
        "",
        "| mode | requests | errors | TTFT p50 (ms) | TTFT p95 (ms) | requests/s "
        "| output tokens/s | answers equal to recompute |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in result["concurrency"]:
        equal = run["answers_equal_recompute"]
        equal_text = "-" if equal is None else f"{equal} of {run['requests']}"
        if run["mode"] == RECOMPUTE and equal is None:
            equal_text = "(the reference)"
        lines.append(
            f"| {run['mode']} | {run['clients']} x {run['requests_per_client']} | {run['errors']} "
            f"| {_ms(run['ttft_p50_s'])} | {_ms(run['ttft_p95_s'])} "
            f"| {run['requests_per_s']:.2f} | {run['output_tokens_per_s']:.1f} "
            f"| {equal_text} |"
        )
    return "\n".join(lines)
