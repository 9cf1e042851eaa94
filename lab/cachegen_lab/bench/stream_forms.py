"""``cachegen stream-bench --forms``: each stored form loaded alone vs the adaptive choice.

1. ``prepare_forms``: the bench's chunks in the store in every form asked for (a cachegen
   level coded or packed, raw, int8, fp8; each codec under its own chunk keys), encoded from
   one prefill when any is missing.
2. ``form_losses``: each form's quality loss (perplexity change, %), the caller's or the
   data's (:mod:`cachegen.codec.form_loss`: a cachegen level's calibration target, its
   packed form the same, 0 for ``raw``, the baselines' measured loss).
3. ``forms_bench``: per shaper and bandwidth, load every form alone and then with
   :class:`~cachegen.stream.FastestController` choosing per chunk among the forms whose loss
   is within the bound, and compare adaptive's time with the best allowed fixed form's
   (recomputation included, at the measured prefill rate).
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Mapping

from cachegen import models
from cachegen.codec import form_loss
from cachegen.errors import InputError
from cachegen.fileio import versioned
from cachegen.modes import CACHEGEN, FORMS, KV_BASELINES, PACKED, TCQ, Form
from cachegen.store import ChunkStore
from cachegen.stream.controller import (
    DEFAULT_SWITCH_MARGIN,
    RECOMPUTE,
    FastestController,
    Option,
    host_bound_mbps,
)
from cachegen_lab.bench.links import UNLIMITED
from cachegen_lab.bench.stream_bench import Prepared, prepare, run_load, warm_up
from cachegen_lab.peers import PEER_MODES

SCHEMA = "cachegen-stream-forms-bench"
VERSION = 2  # 2: forms by name only (no "slot"), prepared forms by name
DEFAULT_FORMS = "default"
WITHIN = 1.10  # adaptive should finish within this factor of the best allowed fixed form


def benched_form(label: str) -> Form:
    """The form of ``label`` when this bench loads it: a cachegen level, coded or packed, a
    baseline or a peer codec of the lab (``lmcache-cachegen``)."""
    try:
        form = Form.parse(label)
    except InputError:
        form = None
    if form is None or form.codec == TCQ:
        raise InputError(
            f"unknown form {label!r}; forms are cachegen-<L>, cachegen-<L>-{PACKED}, "
            f"{', '.join((*KV_BASELINES, *PEER_MODES))} (or {DEFAULT_FORMS!r})"
        )
    return form


def parse_forms(text: str, default_level: int) -> list[Form]:
    """Forms of a comma list; ``default``: the default level coded and packed, and the
    baselines."""
    if text == DEFAULT_FORMS:
        names = [Form(CACHEGEN, default_level, packing).label for packing in FORMS]
        names += list(KV_BASELINES)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names):
        raise InputError(f"--forms {text!r}: give distinct forms separated by commas")
    return [benched_form(n) for n in names]


def parse_losses(text: str | None) -> dict[str, float]:
    """``NAME=PCT,...`` (coded names: a packed form has its coded level's loss)."""
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, _, value = item.partition("=")
        try:
            out[benched_form(name.strip()).coded.label] = float(value)
        except ValueError:
            raise InputError(f"--loss-pct {text!r}: give NAME=PCT pairs, e.g. int8=0.1") from None
    return out


# ---- losses ------------------------------------------------------------------------------


def form_losses(
    spec: models.ModelSpec, cachegen_codec, forms: list[Form], given: Mapping[str, float]
) -> dict[str, float | None]:
    """Each form's loss (None: unknown): ``given`` first, then the data
    (:mod:`cachegen.codec.form_loss`)."""
    fingerprint = spec.identity().fingerprint
    calibrated = cachegen_codec.profile.calibrated_levels() if cachegen_codec is not None else []
    known = form_loss.form_losses([f.label for f in forms], fingerprint, calibrated)
    return {f.label: given.get(f.coded.label, known[f.label]) for f in forms}


def default_bound(cachegen_codec) -> float:
    """The loss of the default cachegen level: adaptive never buys speed with a lossier one."""
    profile = cachegen_codec.profile
    level = cachegen_codec.default_level
    name = f"{CACHEGEN}-{level}"
    fingerprint = profile.model.fingerprint
    loss = form_loss.form_losses([name], fingerprint, profile.calibrated_levels())[name]
    if loss is None:
        raise InputError(
            f"the default level {level} of {profile.model.name} has no calibrated loss: "
            "give --max-loss-pct"
        )
    return loss


# ---- prepare and measure -----------------------------------------------------------------


def prepare_forms(
    store: ChunkStore, model: str, forms: list[Form], ids, chunk_tokens: int, log=None
) -> dict[str, Prepared]:
    """Each codec's chunks in ``store`` in ``forms``, from one prefill."""
    by_codec: dict[str, list[Form]] = {}
    for f in forms:
        by_codec.setdefault(f.codec, []).append(f)
    preps: dict[str, Prepared] = {}
    kv = None
    for codec_name, codec_forms in by_codec.items():
        preps[codec_name] = prepare(
            store, model, codec_name, ids, chunk_tokens, codec_forms, kv=kv, log=log
        )
        kv = preps[codec_name].kv or kv
    return preps


def allowed_names(options: list[Option], max_loss_pct: float) -> list[str]:
    return [o.name for o in options if o.within(max_loss_pct)]


def forms_bench(
    store: ChunkStore,
    preps: dict[str, Prepared],
    forms: list[Form],
    losses: Mapping[str, float | None],
    *,
    max_loss_pct: float,
    shapers,
    bandwidths,
    rtt_ms: float,
    prefill_tps: float,
    repeat: int = 1,
    explore: float = 0.0,
    switch_margin: float = DEFAULT_SWITCH_MARGIN,
    log=None,
) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr))
    for prep in preps.values():
        warm_up(store, prep)  # compiles the kernels and fills caches, which no load pays for
    options = [
        Option(f.label, preps[f.codec].records(f), preps[f.codec].sizes[f], losses[f.label])
        for f in forms
    ]
    anchor = preps[forms[0].codec]  # its keys count the chunks, its tokens check each chunk
    allowed = allowed_names(options, max_loss_pct)
    host_mbps: dict[str, float] = {}  # each form's ceiling so far, over every column
    columns = []
    for shaper in shapers:
        for bw in bandwidths:
            load_before = os.getloadavg()[0]
            column = _measure_column(
                store,
                preps,
                forms,
                options,
                shaper=shaper,
                bw=bw,
                rtt_ms=rtt_ms,
                max_loss_pct=max_loss_pct,
                prefill_tps=prefill_tps,
                repeat=repeat,
                host_mbps=host_mbps,
                explore=explore,
                switch_margin=switch_margin,
            )
            column["loadavg_1min"] = [load_before, os.getloadavg()[0]]
            columns.append(column)
            log(
                f"{shaper:>12} {bw if bw is not None else UNLIMITED:>9} Mbit/s  adaptive "
                f"{column['adaptive_s']:.3f} s  best allowed {column['best_allowed']} "
                f"{column['best_allowed_s']:.3f} s"
            )
    return versioned(
        SCHEMA,
        VERSION,
        {
            "model": anchor.model,
            "tokens": sum(anchor.chunk_tokens),
            "chunks": len(anchor.keys),
            "chunk_tokens": anchor.chunk_tokens[0] if anchor.chunk_tokens else None,
            "rtt_ms": rtt_ms,
            "prefill_tps": prefill_tps,
            "max_loss_pct": max_loss_pct,
            "explore": explore,
            "switch_margin": switch_margin,
            "within": WITHIN,
            "forms": [
                {
                    "name": o.name,
                    "loss_pct": o.loss_pct,
                    "allowed": o.name in allowed,
                    "bytes": sum(s for s in o.sizes if s is not None),
                }
                for o in options
            ],
            "prepared": {name: prep.to_dict() for name, prep in preps.items()},
            "columns": columns,
        },
    )


def _measure_column(
    store,
    preps,
    forms,
    options,
    *,
    shaper,
    bw,
    rtt_ms,
    max_loss_pct,
    prefill_tps,
    repeat,
    host_mbps: dict[str, float],
    explore: float,
    switch_margin: float,
) -> dict:
    """Every form loaded alone, then adaptively, ``repeat`` times in turn (so a busy moment
    hits every form alike). What the adaptive load knows is what a server learns from its
    earlier loads: its decode priors are each form's median rate per chunk in the loads of
    it so far at this rate, and its ceilings (``host_mbps``, updated here) each form's best
    goodput in the loads so far that the host, not the link, bounded."""
    anchor = preps[forms[0].codec]
    fixed: dict[str, list[float]] = {f.label: [] for f in forms}
    rates: dict[str, list[float]] = {f.label: [] for f in forms}
    adaptive = []
    for _ in range(repeat):
        for f in forms:
            stats, _ = run_load(
                store, preps[f.codec], shaper=shaper, bandwidth=bw, rtt_ms=rtt_ms, form=f
            )
            fixed[f.label].append(stats.load_s)
            ceiling = host_bound_mbps(stats.bytes, stats.load_s, bw)
            if ceiling is not None:
                host_mbps[f.label] = max(host_mbps.get(f.label, 0.0), ceiling)
            rates[f.label] += [c.decode_s / anchor.chunk_tokens[c.index] for c in stats.chunks]
        priors = {name: statistics.median(r) for name, r in rates.items()}
        controller = FastestController(
            options,
            anchor.chunk_tokens,
            max_loss_pct=max_loss_pct,
            prefill_tokens_per_s=prefill_tps,
            initial_mbps=bw,
            decode_s_per_token=priors,
            host_mbps=host_mbps,
            explore=explore,
            switch_margin=switch_margin,
        )
        stats, _ = run_load(
            store, anchor, shaper=shaper, bandwidth=bw, rtt_ms=rtt_ms, controller=controller
        )
        adaptive.append(_adaptive_run(stats, anchor, prefill_tps))
    allowed = allowed_names(options, max_loss_pct)
    column = _column(shaper, bw, fixed, adaptive, allowed, sum(anchor.chunk_tokens) / prefill_tps)
    column["decode_s_per_token"] = priors  # the last adaptive load's priors
    column["host_mbps"] = dict(host_mbps)
    return column


def _adaptive_run(stats, anchor: Prepared, prefill_tps: float) -> dict:
    recompute_tokens = (
        sum(anchor.chunk_tokens[stats.recompute_from :]) if stats.recompute_from is not None else 0
    )
    # when each decision predicted the load to end (NaN, no rate known yet: None)
    ends = [d["elapsed_s"] + d["predicted_s"] for d in stats.decisions]
    ends = [end if end == end else None for end in ends]
    recompute_s = recompute_tokens / prefill_tps
    return {
        "load_s": stats.load_s,
        "recompute_s": recompute_s,
        "completion_s": stats.load_s + recompute_s,
        "predicted_s": ends[0] if ends else None,  # at the first chunk
        "predicted_mid_s": ends[len(ends) // 2] if ends else None,  # halfway, rates learned
        "bytes": stats.bytes,
        "transfer_s": stats.transfer_s,
        "decode_s": stats.decode_s,
        "choices": list(stats.forms),
        "decisions": list(stats.decisions),
    }


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _column(shaper, bw, fixed, adaptive, allowed, recompute_s) -> dict:
    load_s = {name: statistics.median(times) for name, times in fixed.items()}
    candidates = {name: load_s[name] for name in allowed} | {RECOMPUTE: recompute_s}
    best = min(candidates, key=lambda name: candidates[name])
    adaptive_s = statistics.median(r["completion_s"] for r in adaptive)
    return {
        "shaper": shaper,
        "bandwidth_mbps": bw,
        "runs": len(adaptive),
        "load_s": load_s,
        "recompute_s": recompute_s,
        "best_allowed": best,
        "best_allowed_s": candidates[best],
        "adaptive_s": adaptive_s,
        "adaptive_predicted_s": _median([r["predicted_s"] for r in adaptive]),
        "adaptive_predicted_mid_s": _median([r["predicted_mid_s"] for r in adaptive]),
        "adaptive_vs_best": adaptive_s / candidates[best],
        "within_target": adaptive_s <= WITHIN * candidates[best],
        "fixed_runs_load_s": fixed,
        "adaptive_runs": adaptive,
    }


def choice_summary(choices: list) -> str:
    """Run-length form of per-chunk choices: ``cachegen-4 x3, int8 x13``."""
    runs: list[list] = []
    for c in choices:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ", ".join(f"{c} x{n}" for c, n in runs)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(result: dict) -> str:
    """The forms (rows) by bandwidth (columns), load_s medians; then adaptive's choices."""
    cols = result["columns"]
    heads = [
        UNLIMITED if c["bandwidth_mbps"] is None else f"{c['bandwidth_mbps']:g} Mbit/s"
        for c in cols
    ]
    width = 2 + max(12, *(len(h) for h in heads), *(len(c["best_allowed"]) for c in cols))
    names = [f["name"] for f in result["forms"]]
    label = max(len(n) for n in [*names, "adaptive / best allowed"]) + 2
    lines = ["load_s".ljust(label) + "".join(h.rjust(width) for h in heads)]
    allowed = {f["name"]: f["allowed"] for f in result["forms"]}
    for name in names:
        mark = "" if allowed[name] else " *"
        cells = "".join(f"{c['load_s'][name]:.3f}".rjust(width) for c in cols)
        lines.append((name + mark).ljust(label) + cells)
    rows = (
        (RECOMPUTE, lambda c: f"{c['recompute_s']:.3f}"),
        ("adaptive", lambda c: f"{c['adaptive_s']:.3f}"),
        ("predicted at chunk 0", lambda c: _seconds(c["adaptive_predicted_s"])),
        ("predicted halfway", lambda c: _seconds(c["adaptive_predicted_mid_s"])),
        ("best allowed", lambda c: c["best_allowed"]),
        ("adaptive / best allowed", lambda c: f"{c['adaptive_vs_best']:.3f}"),
    )
    for name, cell in rows:
        lines.append(name.ljust(label) + "".join(cell(c).rjust(width) for c in cols))
    lines.append(f"* loss above the bound of {result['max_loss_pct']:g}%: not allowed")
    for c, head in zip(cols, heads):
        for i, run in enumerate(c["adaptive_runs"]):
            lines.append(f"{head} run {i + 1}: {choice_summary(run['choices'])}")
    return "\n".join(lines)
