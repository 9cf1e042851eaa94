"""Window-aware transfer through vLLM: what a load of a stored prefix fetches with the
connector's ``skip_out_of_window`` on and off, and whether the answer changes.

For a model with sliding-window and full-attention layers (Gemma 3) the connector stores each
chunk as two records and, with the option on, fetches the sliding layers' record only for the
chunks the window of the reused prefix covers (docs/connector.md, "Window-aware transfer").
One engine stores the context once, answers the prompt by recomputing it, then loads the stored
prefix per mode with the option on and off; the answers are compared token by token:

    cachegen ttft window --model gemma3-270m --context 4096
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cachegen.errors import InputError
from cachegen.modes import RECOMPUTE, Form
from cachegen_lab.bench.ttft import OUTPUT_TOKENS, TTFTBench

MODES = ("raw", "cachegen")
QUESTION_MARGIN_TOKENS = 64  # room for the question and the answer after the context


def window_bench(model: str = "gemma3-270m", context_tokens: int = 4096) -> TTFTBench:
    """An engine that stores raw and the default cachegen level of a model with sliding-window
    layers, sized for ``context_tokens``."""
    from cachegen import models
    from cachegen.profiles import codec_for

    spec = models.resolve(model)
    if not any(models.attention_windows(spec.config)):
        raise InputError(
            f"{model} has no sliding-window layers, so no load skips anything; "
            "use a model with both kinds (gemma3-270m)"
        )
    return TTFTBench(
        model,
        save_modes=MODES,
        cachegen_levels=(codec_for("cachegen", model).default_level,),
        max_model_len=context_tokens + QUESTION_MARGIN_TOKENS + OUTPUT_TOKENS,
    )


def window_rows(
    bench: TTFTBench,
    context_tokens: int = 4096,
    modes: Sequence[str] = MODES,
    *,
    output_tokens: int = OUTPUT_TOKENS,
) -> list[dict[str, Any]]:
    """One row per mode and setting of ``skip_out_of_window`` (True first); ``bench``'s engine
    must save ``modes``."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise InputError(f"modes {unknown} are not measured here; choose from {', '.join(MODES)}")
    prompt = bench.prompt(context_tokens)
    bench.prepare(prompt)
    bench.warm_up(prompt)
    recomputed = bench.engine.run(prompt, mode=RECOMPUTE, max_tokens=output_tokens)
    rows = []
    for mode in modes:
        for skip in (True, False):
            hit = bench.engine.run(
                prompt, mode=mode, skip_out_of_window=skip, max_tokens=output_tokens
            )
            report = hit.connector
            forms = report.get("forms") or [None]
            rows.append(
                {
                    "model": bench.model,
                    "mode": mode,
                    "level": _level(forms[0]) if mode == "cachegen" else None,
                    "context_tokens": context_tokens,
                    "skip_out_of_window": skip,
                    "loaded_tokens": report.get("loaded_tokens", 0),
                    "chunks": report.get("chunks"),
                    "bytes": report.get("bytes"),
                    "sliding_bytes": report.get("sliding_bytes"),
                    "window_skipped_chunks": report.get("window_skipped_chunks"),
                    "output_tokens": len(hit.token_ids),
                    "tokens_equal_recompute": sum(
                        a == b for a, b in zip(hit.token_ids, recomputed.token_ids)
                    ),
                    "load_error": report.get("load_error"),
                }
            )
    return rows


def window_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Bytes fetched with the option on and off per mode, and the answers against recompute."""
    by_mode: dict[str, dict[bool, dict[str, Any]]] = {}
    for row in rows:
        by_mode.setdefault(row["mode"], {})[row["skip_out_of_window"]] = row
    first = rows[0]
    lines = [
        f"{first['model']}, a {first['context_tokens']}-token stored prefix "
        f"({first['chunks']} chunks), {first['output_tokens']} greedy output tokens",
        "",
        "| mode | bytes, on (MB) | bytes, off (MB) | on / off | sliding parts skipped (on) "
        "| tokens equal to recompute, on / off |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for mode, pair in by_mode.items():
        on, off = pair[True], pair[False]
        label = f"cachegen (level {on['level']})" if on["level"] is not None else mode
        if not on["bytes"] or not off["bytes"]:
            why = on["load_error"] or off["load_error"] or "nothing loaded"
            lines.append(f"| {label} | - | - | - | - | {why} |")
            continue
        lines.append(
            f"| {label} | {on['bytes'] / 1e6:.2f} | {off['bytes'] / 1e6:.2f} "
            f"| {on['bytes'] / off['bytes']:.2f}x "
            f"| {on['window_skipped_chunks']} of {on['chunks']} "
            f"| {on['tokens_equal_recompute']} / {off['tokens_equal_recompute']} "
            f"of {on['output_tokens']} |"
        )
    return "\n".join(lines)


def _level(form: str | None) -> int | None:
    """The level of a loaded chunk's form (None: the chunk was not loaded)."""
    return None if form in (None, RECOMPUTE) else Form.parse(form).level
