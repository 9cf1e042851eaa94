"""Hits from the first repeat: how soon after a prefill its chunks are loadable, and what a
question sent the moment the previous answer ends gets.

One engine with the connector's defaults (mode ``cachegen``, the default save ladder, prefix
caching off). Per repeat, over a fresh document each time (nothing of it stored):

* ``delay``: a request saves a ``context``-token document; from the end of its prefill (its
  first token) the store is polled until every whole chunk is loadable (stored at its first
  form, ``LevelPolicy.first_of`` in ``cachegen.connector.ladder``) and until every form of
  the ladder is stored;
* ``repeat``: a first question over the document, then at once a second one; their TTFTs, the
  tokens the second loaded and how long the scheduler held it for the save (``save_wait_s``).

    cachegen ttft repeat --model smollm2-135m --context 3072
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from cachegen import workload
from cachegen.connector.config import RequestOptions
from cachegen.errors import InputError
from cachegen.models import EMBEDDED_DEFAULT
from cachegen.modes import CACHEGEN
from cachegen_lab.bench.ttft import TTFTBench

QUESTIONS = (
    "\n\nQuestion: what does the text above explain? Answer:",
    "\n\nQuestion: which examples does the text above give? Answer:",
)
DOCUMENT_STRIDE_CHARS = 15_000  # each document starts this far after the previous one
POLL_S = 0.005


def repeat_bench(model: str = EMBEDDED_DEFAULT, context_tokens: int = 3072) -> TTFTBench:
    """An engine with the connector's default storage (``cachegen``, the default ladder)."""
    return TTFTBench(
        model,
        save_modes=(CACHEGEN,),
        cachegen_levels=None,
        max_model_len=context_tokens + 256,
    )


def _wait_until(condition: Any, timeout_s: float) -> float | None:
    """Seconds (perf_counter) when ``condition()`` first held, polled; None on timeout."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if condition():
            return time.perf_counter()
        time.sleep(POLL_S)
    return None


def delay_row(
    bench: TTFTBench, document: Sequence[int], output_tokens: int, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Save ``document`` + a question; seconds from the end of its prefill until every whole
    chunk is loadable, and until every level is stored."""
    engine = bench.engine
    prompt = list(document) + engine.tokenize(QUESTIONS[0], bos=False)
    chunks = len(prompt) // bench.chunk_tokens
    transport = engine.transport
    options, modes = RequestOptions(mode=CACHEGEN), engine.config.save_modes
    marks: dict[str, float] = {}

    def mark() -> bool:
        """Note when each condition first holds (checked between engine steps, then polled)."""
        now = time.perf_counter()
        if "loadable" not in marks and transport.stored_chunks(prompt, options) >= chunks:
            marks["loadable"] = now
        if "every" not in marks and transport.saved_chunks(prompt, modes) >= chunks:
            marks["every"] = now
        return False

    request = engine.submit(prompt, mode=CACHEGEN, save=True, max_tokens=output_tokens)
    engine.step_until_done([request], until=lambda: bool(request.token_times))
    prefill_end = request.token_times[0]
    engine.step_until_done([request], until=mark)
    _wait_until(lambda: mark() or len(marks) == 2, timeout_s)
    loadable, every = marks.get("loadable"), marks.get("every")
    return {
        "model": bench.model,
        "prompt_tokens": len(prompt),
        "chunks": chunks,
        "levels": [f.label for f in transport.forms(CACHEGEN)],  # the ladder's forms
        "output_tokens": output_tokens,
        "loadable_s": None if loadable is None else loadable - prefill_end,
        "every_level_s": None if every is None else every - prefill_end,
    }


def repeat_row(bench: TTFTBench, document: Sequence[int], output_tokens: int) -> dict[str, Any]:
    """A first question over ``document``, then a second one the moment the first answer's last
    token arrived (both saving, as served requests do)."""
    engine = bench.engine
    first, second = (
        engine.run(
            list(document) + engine.tokenize(q, bos=False),
            mode=CACHEGEN,
            save=True,
            max_tokens=output_tokens,
        )
        for q in QUESTIONS
    )
    return {
        "model": bench.model,
        "prompt_tokens": second.prompt_tokens,
        "output_tokens": output_tokens,
        "first_ttft_s": first.ttft_s,
        "second_ttft_s": second.ttft_s,
        "ttft_ratio": second.ttft_s / first.ttft_s,
        "loaded_tokens": second.connector.get("loaded_tokens", 0),
        "save_wait_s": second.connector.get("save_wait_s", 0.0),
        "load_error": second.connector.get("load_error"),
    }


def repeat_rows(
    bench: TTFTBench,
    context_tokens: int = 3072,
    *,
    output_tokens: int = 32,
    repeats: int = 3,
) -> list[dict[str, Any]]:
    """``repeats`` delay rows then ``repeats`` repeat rows, each over a document of its own
    (after one warm-up of each on another document)."""
    text = workload.text("eval")
    documents = []
    for i in range(2 * repeats + 2):
        start = i * DOCUMENT_STRIDE_CHARS
        ids = bench.engine.tokenize(text[start : start + 8 * context_tokens])
        if len(ids) < context_tokens:
            raise InputError(
                f"the evaluation text holds no {2 * repeats + 2} documents of {context_tokens} "
                "tokens; use a shorter --context or fewer --repeats"
            )
        documents.append(ids[:context_tokens])
    delay_row(bench, documents[0], output_tokens)  # codec kernels, links: one-time costs
    repeat_row(bench, documents[1], output_tokens)
    rows = [
        {"kind": "delay", **delay_row(bench, documents[2 + i], output_tokens)}
        for i in range(repeats)
    ]
    rows += [
        {"kind": "repeat", **repeat_row(bench, documents[2 + repeats + i], output_tokens)}
        for i in range(repeats)
    ]
    return rows


def _median(rows: Sequence[dict[str, Any]], key: str) -> str:
    values = [r[key] for r in rows if r.get(key) is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def repeat_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Medians over the repeats: the save's delays, and the immediate repeat's TTFT."""
    delays = [r for r in rows if r["kind"] == "delay"]
    repeats = [r for r in rows if r["kind"] == "repeat"]
    head = delays[0] if delays else repeats[0]
    lines = [
        f"{head['model']}, {head['prompt_tokens']}-token prompts, {head['output_tokens']} "
        f"output tokens, medians of {max(len(delays), len(repeats))}",
        "",
    ]
    if delays:
        lines += [
            "| chunks | levels | prefill end -> all chunks loadable (s) "
            "| prefill end -> every level stored (s) |",
            "| ---: | --- | ---: | ---: |",
            f"| {head['chunks']} | {head['levels']} | {_median(delays, 'loadable_s')} "
            f"| {_median(delays, 'every_level_s')} |",
            "",
        ]
    if repeats:
        loaded = sorted({r["loaded_tokens"] for r in repeats})
        lines += [
            "| first TTFT (s) | immediate repeat TTFT (s) | ratio | held for the save (s) "
            "| tokens loaded |",
            "| ---: | ---: | ---: | ---: | ---: |",
            f"| {_median(repeats, 'first_ttft_s')} | {_median(repeats, 'second_ttft_s')} "
            f"| {_median(repeats, 'ttft_ratio')} | {_median(repeats, 'save_wait_s')} "
            f"| {'/'.join(map(str, loaded))} |",
        ]
    return "\n".join(lines)
