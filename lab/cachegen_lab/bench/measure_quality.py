"""Answer quality of each KV mode: perplexity change and top-1 agreement with decoded KV.

A thin use of ``cachegen_lab.quality``: windows of held-out CPython documentation text, each
mode's codec as a candidate (real encode, real decode of the real bitstream), scored
teacher-forced against the original KV. Greedy generation is left to ``cachegen eval``,
which measures it in depth; the sweep keeps to the two numbers the paper's claim needs.
"""

from __future__ import annotations

from cachegen.errors import CacheGenError
from cachegen.modes import Mode

CONTINUATION_TOKENS = 128  # scored tokens per window


def measure_quality(cfg, model: str, *, quality: list, missing: list, tick) -> None:
    modes = [m for m in cfg.modes_of(model) if m.codec_name is not None]
    if not modes or cfg.quality_windows == 0:
        return

    def unmeasured(mode: Mode, exc: Exception) -> None:
        missing.append(
            {
                "kind": "quality",
                "model": model,
                "mode": mode.mode,
                "level": mode.level,
                "context_tokens": cfg.quality_context_tokens,
                "bandwidth_mbps": None,
                "reason": f"{type(exc).__name__}: {exc}",
            }
        )

    try:
        from cachegen import models
        from cachegen.extract import load_model
        from cachegen_lab.quality.datasets import pydoc_windows
        from cachegen_lab.quality.evaluate import EvalSettings, evaluate

        spec = models.resolve(model)
        _, tokenizer, _ = load_model(spec)
        windows = pydoc_windows(
            tokenizer,
            count=cfg.quality_windows,
            context_tokens=cfg.quality_context_tokens,
            continuation_tokens=CONTINUATION_TOKENS,
            seed=0,
        )
        candidates, measured = [], []
        for mode in modes:
            try:
                candidates.append(_candidate(spec, mode))
                measured.append(mode)
            except (
                CacheGenError
            ) as exc:  # e.g. a level the profile lacks: only this mode is missing
                unmeasured(mode, exc)
        rows = (
            evaluate(model, windows, candidates, EvalSettings(gen_windows=0), progress=False)
            if candidates
            else []
        )
    except CacheGenError as exc:
        for mode in modes:
            unmeasured(mode, exc)
        tick()
        return
    for mode, row in zip(measured, rows):
        quality.append(
            {
                "model": model,
                "mode": mode.mode,
                "level": mode.level,
                "codec": row["codec"],
                "context_tokens": cfg.quality_context_tokens,
                "windows": row["windows"],
                "bits_per_element": row["bits_per_element"],
                "ppl_change_pct": row["ppl_change_pct"],
                "top1_agreement": row["top1_agreement"],
                "kl": row.get("kl"),
            }
        )
    tick()


def _candidate(spec, mode: Mode):
    from cachegen.profiles import codec_for
    from cachegen_lab.quality.candidates import codec_candidates

    level = codec_for(mode.codec_name, spec).resolve_level(mode.level)
    (candidate,) = codec_candidates(spec, mode.codec_name, [str(level)])
    return candidate
