"""Shared pieces of the asv suites: the sweep configuration, the one expensive sweep, lookups.

The suites are thin. ``sweep`` is the ``setup_cache`` of every end-to-end class: asv runs it
once per run (same function, same cache key), it measures the whole sweep with
``cachegen_lab.bench`` (one vLLM engine per model) and writes the results document into asv's
cache directory; each ``track_*`` then reads one number from it.

Environment variables:
  CACHEGEN_BENCH_PROFILE  ``default`` (what ``make bench`` runs) or ``quick`` (smoke run)
  CACHEGEN_BENCH_MODELS   extra models, comma-separated (e.g. ``facebook/opt-125m``)
  CACHEGEN_BENCH_OUT      also write the results document here (``make bench`` sets
                          benchmarks/results.json)
"""

from __future__ import annotations

import functools
import json
import os

from cachegen_lab.bench import results
from cachegen_lab.bench.sweep import profile, run_sweep

PROFILE = os.environ.get("CACHEGEN_BENCH_PROFILE", "default")
CONFIG = profile(PROFILE)
MODELS = list(CONFIG.models)
# asv matches parameters by position between discovery and each run, and a codec profile may
# gain a calibrated level in between: CacheGen levels go last, so an added one shifts nothing.
_ORDERED = sorted(CONFIG.modes, key=lambda m: (m.mode == "cachegen", m.level or 0))
MODES = [m.label for m in _ORDERED]
KV_MODES = [m.label for m in _ORDERED if m.moves_kv]
CODEC_MODES = [m.label for m in _ORDERED if m.codec_name is not None]
MODEL_MODES = {model: {m.label for m in CONFIG.modes_of(model)} for model in MODELS}
QUICK = PROFILE == "quick"
BANDWIDTHS = [int(b) if float(b).is_integer() else b for b in CONFIG.bandwidth_mbps]
CONTEXTS = list(CONFIG.context_tokens)
RESULTS_FILE = "results.json"  # inside asv's setup_cache directory (the working directory)


def sweep() -> str:
    doc = run_sweep(CONFIG, command=f"asv run (CACHEGEN_BENCH_PROFILE={PROFILE})", progress=False)
    results.save(doc, RESULTS_FILE)
    extra = os.environ.get("CACHEGEN_BENCH_OUT")
    if extra:
        results.save(doc, extra)
    return os.path.abspath(RESULTS_FILE)


sweep.timeout = 3600  # seconds; the default profile takes under 25 minutes on 2 cores


@functools.lru_cache(maxsize=1)
def _document(path: str) -> dict:
    """The sweep's results document. ``sweep`` validated it when it wrote it; asv calls
    ``setup`` once per parameter combination, hundreds of times, and validating the schema
    again each time would add minutes to a run."""
    with open(path) as f:
        return json.load(f)


def median_row(path: str, kind: str, model: str, mode: str, bandwidth_mbps, context_tokens) -> dict:
    """The median row of one cell, or NotImplementedError (asv: skipped) when it was not
    measured."""
    from cachegen.modes import Mode

    parsed = Mode.parse(mode)
    rows = results.lookup(
        _document(path),
        kind=kind,
        model=model,
        mode=parsed.mode,
        level=parsed.level,
        context_tokens=context_tokens,
    )
    rows = [
        r for r in rows if r["bandwidth_mbps"] in (None, bandwidth_mbps) or bandwidth_mbps is None
    ]
    if not rows:
        raise NotImplementedError(
            f"{kind} {model} {mode} {bandwidth_mbps} {context_tokens} was not measured"
        )
    return rows[0]


def quality_row(path: str, model: str, mode: str) -> dict:
    from cachegen.modes import Mode

    parsed = Mode.parse(mode)
    rows = [
        q
        for q in _document(path)["quality"]
        if q["model"] == model and q["mode"] == parsed.mode and q["level"] == parsed.level
    ]
    if not rows:
        raise NotImplementedError(f"quality of {model} {mode} was not measured")
    return rows[0]


def value(row: dict, metric: str) -> float:
    """A metric of a row; NaN (asv: n/a) when the measuring component did not report it."""
    number = row.get(metric)
    return float("nan") if number is None else float(number)
