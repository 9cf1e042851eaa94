"""The CacheGen paper's three claims judged against a results document, for each codec that
reaches for them (``CODECS``: CacheGen, the paper's codec, and tcq, this project's): per claim
and codec the best level at negligible loss with its number, a verdict that says which codec
reaches the claim, and the tables behind them. Beside them, each peer codec of the lab
(``PEERS``: LMCache's CacheGen, one form) gets its number per claim and model, unjudged.
``cachegen_lab.bench.reproduction`` renders them into docs/reproduction.md.

The paper's numbers are quoted from the paper (SIGCOMM 2024, abstract and section 7); every
other number comes from the results document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cachegen.modes import ADAPTIVE, ADAPTIVE_FASTEST, CACHEGEN, TCQ, Mode
from cachegen_lab.bench.links import link_label, link_order
from cachegen_lab.peers import PEER_NAMES

PAPER = {
    "size_vs_int8": (3.5, 4.3),
    "delay": (3.2, 3.7),
}
SIZE_CLAIM = "KV 3.5-4.3x smaller than 8-bit quantization"
DELAY_CLAIM = "3.2-3.7x lower delay of fetching and processing the context"
QUALITY_CLAIM = "negligible loss of response quality"
# What "negligible" means in this report; the paper reports accuracy drops under ~2%.
NEGLIGIBLE_PPL_PCT = 2.0
CODECS = {CACHEGEN: "CacheGen", TCQ: "tcq"}  # the codecs judged, and their names in the report
PEERS = PEER_NAMES  # the peer codecs shown beside them, and their names in the report
NAMES = {**CODECS, **PEERS}
SEE_MISSING = "not measured (see Not measured in this run)"
NOT_MEASURED = "not measured"
# Per model, a codec's levels with their claim's score (higher is better) and its text.
Scored = dict[str, dict[int, tuple[float, str]]]


@dataclass
class Claim:
    """One claim: its row of the claims table (``best``: per codec of ``CODECS``, its best
    level at negligible loss with its number, per model; ``peers``: per peer codec of
    ``PEERS``, its number per model) and its section (``details``)."""

    title: str
    claim: str
    paper: str
    best: dict[str, str]
    verdict: str
    details: list[str]
    peers: dict[str, str]


def claims(doc: dict) -> list[Claim]:
    return [size_claim(doc), delay_claim(doc), quality_claim(doc)]


# ---- the best level of each codec ---------------------------------------------------------


def negligible_levels(doc: dict, model: str, codec: str) -> set[int]:
    """``codec``'s levels whose measured perplexity change on ``model`` is within
    NEGLIGIBLE_PPL_PCT."""
    return {
        q["level"]
        for q in doc["quality"]
        if q["model"] == model and q["mode"] == codec and q["ppl_change_pct"] <= NEGLIGIBLE_PPL_PCT
    }


def _best(doc: dict, codec: str, scored: Scored) -> tuple[str, list[float]]:
    """The claims table's cell of ``codec`` (per model, in the configured order, the level of
    the highest score among those with negligible loss: ``model level L: text``) and those
    levels' scores."""
    parts, scores = [], []
    for model in [m for m in doc["config"]["models"] if scored.get(m)]:
        levels = scored[model]
        good = negligible_levels(doc, model, codec) & set(levels)
        if good:
            level = max(good, key=lambda lv: levels[lv][0])
            parts.append(f"{model} level {level}: {levels[level][1]}")
            scores.append(levels[level][0])
        elif any(q["model"] == model and q["mode"] == codec for q in doc["quality"]):
            parts.append(f"{model}: no level with negligible loss")
        else:
            parts.append(f"{model}: loss not measured")
    return "; ".join(parts) or NOT_MEASURED, scores


def _judged(
    doc: dict, scored: dict[str, Scored], judge: Callable[[list[float]], str]
) -> tuple[dict[str, str], str]:
    """Each codec's cell (:func:`_best`) and the verdict: per codec, ``judge`` of its best
    levels' scores."""
    cells, verdicts = {}, []
    for codec, name in CODECS.items():
        cells[codec], scores = _best(doc, codec, scored[codec])
        if cells[codec] == NOT_MEASURED:
            verdicts.append(f"{name}: {NOT_MEASURED}")
        elif not scores:
            verdicts.append(f"{name}: no level with negligible loss")
        else:
            verdicts.append(f"{name}: {judge(scores)}")
    measured = any(cell != NOT_MEASURED for cell in cells.values())
    return cells, "; ".join(verdicts) if measured else NOT_MEASURED


def _compare_with(paper: tuple[float, float]) -> Callable[[list[float]], str]:
    def judge(values: list[float]) -> str:
        lo, hi = min(values), max(values)
        if lo >= paper[0]:
            return "matches or beats the paper"
        if hi >= paper[0]:
            return "partly reaches the paper's range"
        return f"below the paper's range (best {x(hi)})"

    return judge


# ---- KV size --------------------------------------------------------------------------------


def size_claim(doc: dict) -> Claim:
    rows = [
        r
        for r in doc["medians"]
        if r["kind"] == "stream" and r["mode"] in NAMES and r.get("ratio_vs_int8")
    ]
    details = [
        "Bytes of the whole context's KV as stored (payload, probability tables, scales and "
        "headers all counted) relative to the same KV in int8 with a per-token scale, the paper's "
        "8-bit baseline. "
        "From the `stream` runs (`ratio_vs_int8`), largest context per model.",
        "",
    ]
    scored: dict[str, Scored] = {codec: {} for codec in CODECS}
    if rows:
        details += [
            "| model | context | codec | level | bits/element | ratio vs fp16 | ratio vs int8 |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
    for model, context, at in at_largest_context(doc, rows):
        # Sizes do not depend on the link: one row per level (the slowest link's cell).
        per_level: dict[tuple[str, int], dict] = {}
        for r in sorted(at, key=lambda r: link_order(r["bandwidth_mbps"])):
            per_level.setdefault((r["mode"], r["level"]), r)
        for (codec, level), r in sorted(per_level.items(), key=lambda kv: _codec_order(*kv[0])):
            if codec in CODECS:
                ratio = r["ratio_vs_int8"]
                scored[codec].setdefault(model, {})[level] = (ratio, x(ratio))
            details.append(
                f"| {model} | {context} | {NAMES[codec]} | "
                f"{_level(level)}{_note(doc, model, codec, level)} | "
                f"{num(r.get('bits_per_element'))} | "
                f"{x(r.get('ratio_vs_fp16'))} | {x(r['ratio_vs_int8'])} |"
            )
    details += _unmeasured(doc, "stream", scored)
    best, verdict = _judged(doc, scored, _compare_with(PAPER["size_vs_int8"]))
    peers = peer_cells(doc, "stream", lambda at: x(at[0].get("ratio_vs_int8")))
    title = "KV size vs 8-bit quantization"
    return Claim(title, SIZE_CLAIM, "3.5-4.3x", best, verdict, details, peers)


# ---- delay ---------------------------------------------------------------------------------


def delay_claim(doc: dict) -> Claim:
    details = [
        "Time to first token through vLLM (fetching the context's KV over the rate-limited link, "
        "decoding it, injecting it, and computing the question) of each codec level and of the "
        "adaptive modes against int8 and against text recompute at the same link speed. From "
        "the `e2e` runs (`ttft_s`, medians), largest context.",
        "",
    ]
    e2e = [r for r in doc["medians"] if r["kind"] == "e2e" and r.get("ttft_s")]
    table, scored, spans = _e2e_delay(doc, e2e)
    if table:
        details += [*table, "", *spans, ""]
    details += _stream_delay(doc)
    details += _unmeasured(doc, "e2e", scored)
    best, verdict = _judged(doc, scored, _compare_with(PAPER["delay"]))
    peers = peer_cells(doc, "e2e", lambda at: _speedups_over_int8(e2e, at))
    title = "Delay of fetching and processing the context"
    return Claim(title, DELAY_CLAIM, "3.2-3.7x", best, verdict, details, peers)


def _e2e_delay(doc: dict, e2e: list[dict]) -> tuple[list[str], dict[str, Scored], list[str]]:
    """TTFT of each codec level and adaptive mode against int8 and text recompute: the table,
    each codec level's best speedup over int8 (its score) and the spans of the speedups."""
    modes = (*CODECS, ADAPTIVE, ADAPTIVE_FASTEST, *PEERS)
    rows = [r for r in e2e if r["mode"] in modes]
    scored: dict[str, Scored] = {codec: {} for codec in CODECS}
    speedups: dict[tuple[str, str], list[float]] = {}
    lines = [
        "| model | context | link (Mbit/s) | mode | TTFT (s) | int8 TTFT / TTFT | "
        "recompute TTFT / TTFT |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model, context, at in at_largest_context(doc, rows):
        text = first(e2e, model=model, context_tokens=context, mode="recompute")
        for r in sorted(
            at, key=lambda r: (r["bandwidth_mbps"], *_codec_order(r["mode"], r["level"]))
        ):
            int8 = first(e2e, **cell_of(r), mode="int8")
            vs_int8 = int8["ttft_s"] / r["ttft_s"] if int8 else None
            vs_text = text["ttft_s"] / r["ttft_s"] if text else None
            for against, ratio in (("int8", vs_int8), ("text recompute", vs_text)):
                if ratio:
                    speedups.setdefault((r["mode"], against), []).append(ratio)
            if vs_int8 and r["mode"] in CODECS:  # a level's score: its best speedup over int8
                levels = scored[r["mode"]].setdefault(model, {})
                if vs_int8 > levels.get(r["level"], (0.0, ""))[0]:
                    levels[r["level"]] = (
                        vs_int8,
                        f"{x(vs_int8)} at {r['bandwidth_mbps']:g} Mbit/s",
                    )
            label = Mode(r["mode"], r["level"]).label + _note(doc, model, r["mode"], r["level"])
            lines.append(
                f"| {model} | {context} | {r['bandwidth_mbps']:g} | {label} | "
                f"{num(r['ttft_s'], 3)} | {x(vs_int8)} | {x(vs_text)} |"
            )
    if len(lines) == 2:
        return [], scored, []
    return lines, scored, _spans(speedups)


def _spans(speedups: dict[tuple[str, str], list[float]]) -> list[str]:
    """One sentence per mode family: the span of its TTFT speedups over every level and link."""
    names = {**CODECS, ADAPTIVE: "adaptive", ADAPTIVE_FASTEST: "adaptive-fastest", **PEERS}
    out = []
    for mode, name in names.items():
        spans = [
            f"{span(speedups[(mode, against)])} vs {against}"
            for against in ("int8", "text recompute")
            if (mode, against) in speedups
        ]
        if spans:
            out.append(f"{name} over every level and link: {', '.join(spans)}.")
    return [" ".join(out)] if out else []


def _stream_delay(doc: dict) -> list[str]:
    """Load time (fetch and decode, pipelined) of int8 vs each codec level without vLLM."""
    rows = [r for r in doc["medians"] if r["kind"] == "stream" and r.get("load_s")]
    codec_rows = [r for r in rows if r["mode"] in NAMES]
    if not codec_rows:
        return []
    out = [
        "Load time without vLLM (the `stream` runs: first byte requested to last chunk decoded, "
        "fetch and decode pipelined), which isolates the link and the codec:",
        "",
        "| model | context | link (Mbit/s) | mode | load (s) | int8 load / load |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model, context, at in at_largest_context(doc, codec_rows):
        order = sorted(
            at,
            key=lambda r: (link_order(r["bandwidth_mbps"]), *_codec_order(r["mode"], r["level"])),
        )
        for r in order:
            int8 = first(rows, **cell_of(r), mode="int8")
            ratio = int8["load_s"] / r["load_s"] if int8 else None
            out.append(
                f"| {model} | {context} | {link_label(r['bandwidth_mbps'])} | "
                f"{Mode(r['mode'], r['level']).label} | {num(r['load_s'], 3)} | {x(ratio)} |"
            )
    return out


# ---- quality -------------------------------------------------------------------------------


def quality_claim(doc: dict) -> Claim:
    details = [
        "Perplexity of a continuation and top-1 next-token agreement when the model continues "
        "from the decoded KV instead of the original (cachegen_lab.quality, teacher-forced "
        "through transformers). "
        f"This report calls a perplexity change of at most {NEGLIGIBLE_PPL_PCT:g}% negligible; "
        "a codec's best level here is its smallest (fewest bits/element) with negligible loss.",
        "",
    ]
    scored: dict[str, Scored] = {codec: {} for codec in CODECS}
    if doc["quality"]:
        details += [
            "| model | mode | bits/element | perplexity change | top-1 agreement | "
            "windows x tokens |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
    for q in sorted(doc["quality"], key=lambda q: (q["model"], q["bits_per_element"])):
        if q["mode"] in CODECS:
            scored[q["mode"]].setdefault(q["model"], {})[q["level"]] = (
                -q["bits_per_element"],
                _loss(q),
            )
        details.append(
            f"| {q['model']} | {Mode(q['mode'], q['level']).label} | "
            f"{num(q['bits_per_element'])} | {q['ppl_change_pct']:+.2f}% | "
            f"{100 * q['top1_agreement']:.1f}% | {q['windows']} x {q['context_tokens']} |"
        )
    details += _defaults(doc)
    details += _unmeasured(doc, "quality", scored)
    best, verdict = _judged(doc, scored, lambda scores: "holds")
    peers = peer_cells(doc, "quality", lambda at: _loss(at[0]))
    return Claim("Quality", QUALITY_CLAIM, "accuracy within ~2%", best, verdict, details, peers)


def _defaults(doc: dict) -> list[str]:
    """The default levels per model, and adaptive-fastest's quality bounds."""
    cfg = doc["config"]
    names = {"default_levels": "cachegen", "tcq_default_levels": "tcq (the connector's default)"}
    parts = [
        f"{name}: " + ", ".join(f"{m} {lvl}" for m, lvl in cfg[key].items() if lvl is not None)
        for key, name in names.items()
        if any(lvl is not None for lvl in (cfg.get(key) or {}).values())
    ]
    bounds = cfg.get("max_loss_pct") or {}
    if bounds:
        each = ", ".join(f"{m} {b:g}%" for m, b in bounds.items())
        parts.append(f"adaptive-fastest's bound (the tcq default level's target): {each}")
    if not parts:
        return []
    what = "Default levels per model (what a request that names none gets)"
    return ["", f"{what}: {'; '.join(parts)}."]


# ---- the peers -------------------------------------------------------------------------------


def peer_cells(doc: dict, kind: str, number: Callable[[list[dict]], str | None]) -> dict[str, str]:
    """Per peer codec of ``PEERS``, its number per model: ``number`` of its rows of ``kind``
    (medians; quality rows) on that model at its largest context, or where it was asked for
    and not measured, a pointer to the reason."""
    rows = doc["quality"] if kind == "quality" else [r for r in doc["medians"] if r["kind"] == kind]
    cells = {}
    for peer in PEERS:
        found = {
            m: at for m, _, at in at_largest_context(doc, [r for r in rows if r["mode"] == peer])
        }
        missing = {m["model"] for m in doc["missing"] if m["kind"] == kind and m["mode"] == peer}
        parts = [
            f"{model}: {number(found[model]) or NOT_MEASURED}"
            if model in found
            else f"{model}: {SEE_MISSING}"
            for model in doc["config"]["models"]
            if model in found or model in missing
        ]
        cells[peer] = "; ".join(parts) or NOT_MEASURED
    return cells


def _speedups_over_int8(e2e: list[dict], rows: list[dict]) -> str | None:
    """int8's TTFT over each of ``rows``' at the same link, slowest link first."""
    parts = []
    for r in sorted(rows, key=lambda r: r["bandwidth_mbps"]):
        int8 = first(e2e, **cell_of(r), mode="int8")
        if int8 and r.get("ttft_s"):
            parts.append(f"{x(int8['ttft_s'] / r['ttft_s'])} at {r['bandwidth_mbps']:g} Mbit/s")
    return ", ".join(parts) or None


def _loss(q: dict) -> str:
    return f"{q['ppl_change_pct']:+.1f}% at {num(q['bits_per_element'])} bits/element"


# ---- shared ----------------------------------------------------------------------------------


def _unmeasured(doc: dict, kind: str, scored: dict[str, Scored]) -> list[str]:
    """For each codec with no rows here, why it was not measured (the reasons in ``missing``)."""
    out = []
    for codec, name in CODECS.items():
        if any(scored[codec].values()):
            continue
        reasons = sorted(
            {m["reason"] for m in doc["missing"] if m["kind"] == kind and m["mode"] == codec}
        )
        why = "; ".join(reasons) if reasons else f"no {codec} runs of kind {kind} in this file"
        out += ["", f"{name} not measured in this run: {why}."]
    return out


def _level(level: int | None) -> str:
    return "-" if level is None else str(level)


def _note(doc: dict, model: str, codec: str, level: int | None) -> str:
    return " (negligible loss)" if level in negligible_levels(doc, model, codec) else ""


def _codec_order(mode: str, level: int | None) -> tuple[int, int]:
    """CacheGen's levels, then tcq's, then the adaptive modes, then the peers."""
    order = (*CODECS, ADAPTIVE, ADAPTIVE_FASTEST, *PEERS)
    return order.index(mode), level or 0


def at_largest_context(doc: dict, rows: list[dict]):
    """Per model of ``rows`` (in the configured order): its largest context and its rows there."""
    present = {r["model"] for r in rows}
    for model in [m for m in doc["config"]["models"] if m in present]:
        context = max(r["context_tokens"] for r in rows if r["model"] == model)
        yield (
            model,
            context,
            [r for r in rows if r["model"] == model and r["context_tokens"] == context],
        )


def cell_of(row: dict) -> dict:
    """The model, context and link of ``row``: what a baseline must share to compare."""
    return {k: row[k] for k in ("model", "context_tokens", "bandwidth_mbps")}


def first(rows: list[dict], **where) -> dict | None:
    return next((r for r in rows if all(r[k] == v for k, v in where.items())), None)


def span(values: list[float]) -> str:
    return f"{x(min(values))}-{x(max(values))}"


def x(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"


def num(value: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"
