"""A synthetic results document of the default profile's shape, made without measuring: two
models, each with its own cachegen and tcq default levels, adaptive and adaptive-fastest,
raw and the paper's levels at the largest context only, the peer ``lmcache-cachegen`` there at
two links (end to end on SMALL only: LARGE's is missing, as a model whose records the peer
refuses), and quality rows whose losses decide which level of each codec is negligible. Its
numbers are chosen, so tests can say what the report and the figures must show.

Per model: ``BITS`` (bits per KV element of each codec mode), ``PPL`` (perplexity change, %).
A load at B Mbit/s takes the bytes' time on the link plus ``DECODE_S`` per codec level;
recompute takes ``RECOMPUTE_S`` per 1,000 tokens.
"""

from __future__ import annotations

import json

from cachegen.modes import Mode
from cachegen_lab.bench import results
from cachegen_lab.bench.modes import union
from cachegen_lab.bench.sweep import SweepConfig
from cachegen_lab.peers import LMCACHE_CACHEGEN as PEER
from cachegen_lab.rows import Run
from tests.support import FIXTURES

SMALL, LARGE = "smollm2-135m", "gemma3-270m"
ELEMENTS_PER_TOKEN = {SMALL: 30 * 3 * 64 * 2, LARGE: 18 * 256 * 2}
LABELS = {
    SMALL: ["recompute", "raw", "int8", "cachegen-1", "cachegen-2", "cachegen-3", "cachegen-11"]
    + ["tcq-24", "adaptive", "adaptive-fastest", PEER],
    LARGE: ["recompute", "raw", "int8", "cachegen-1", "cachegen-2", "cachegen-3", "cachegen-9"]
    + ["tcq-25", "adaptive", "adaptive-fastest", PEER],
}
BITS = {
    SMALL: {"raw": 16.0, "int8": 8.08, "cachegen-1": 2.14, "cachegen-2": 2.64}
    | {"cachegen-3": 3.48, "cachegen-11": 2.94, "tcq-24": 2.15, PEER: 4.6},
    LARGE: {"raw": 16.0, "int8": 8.08, "cachegen-1": 1.70, "cachegen-2": 2.17}
    | {"cachegen-3": 2.96, "cachegen-9": 3.43, "tcq-25": 2.67, PEER: 4.4},
}
PPL = {  # negligible: SMALL cachegen-3, cachegen-11, tcq-24; LARGE cachegen-9, tcq-25
    SMALL: {"raw": 0.0, "int8": 0.1, "cachegen-1": 7.8, "cachegen-2": 5.6}
    | {"cachegen-3": -0.2, "cachegen-11": 0.6, "tcq-24": 0.8, PEER: 1.1},
    LARGE: {"raw": 0.0, "int8": 0.2, "cachegen-1": 19.1, "cachegen-2": 10.6}
    | {"cachegen-3": 2.2, "cachegen-9": -0.8, "tcq-25": 1.5, PEER: 0.9},
}
ADAPTIVE_BITS = {"adaptive": 2.5, "adaptive-fastest": 2.3}  # what they loaded, on average
DECODE_S, RECOMPUTE_S, QUESTION_S = 0.05, 1.0, 0.1
LINKS = [100.0, 1000.0]
PEER_LINKS = [100.0, 1000.0]  # the stream part's unlimited link is left out
CONTEXTS = [1536, 4096]
PEER_REFUSED = "lmcache-cachegen cannot encode the connector's records of " + LARGE


def config() -> SweepConfig:
    model_modes = {m: [Mode.parse(label) for label in labels] for m, labels in LABELS.items()}
    largest = ["raw", "cachegen-1", "cachegen-2", "cachegen-3", PEER]
    return SweepConfig(
        models=[SMALL, LARGE],
        modes=union(model_modes.values()),
        model_modes=model_modes,
        largest_context_modes=[Mode.parse(label) for label in largest],
        max_loss_pct={SMALL: 1.0, LARGE: 2.0},
        mode_bandwidth_mbps={PEER: PEER_LINKS},
        bandwidth_mbps=LINKS,
        stream_bandwidth_mbps=[*LINKS, None],
        context_tokens=CONTEXTS,
        repeats=2,
    )


def document() -> dict:
    """The synthetic document, validated against the results schema."""
    cfg = config()
    environment = json.loads((FIXTURES / "bench_results.json").read_text())["environment"]
    doc = results.new_document(
        "synthetic (tests/lab/bench/synthetic_results.py)", environment, cfg.to_json()
    )
    doc["config"]["default_levels"] = {SMALL: 11, LARGE: 9}
    doc["config"]["tcq_default_levels"] = {SMALL: 24, LARGE: 25}
    for model in cfg.models:
        for context in CONTEXTS:
            for mode in cfg.modes_at(model, context):
                refused = (model, mode.mode) == (LARGE, PEER)
                doc["runs"] += _runs(cfg, model, mode, context, e2e=not refused)
                if refused:
                    doc["missing"].append(_missing(mode, context))
        doc["quality"] += [_quality(model, label) for label in PPL[model]]
    return results.finish(doc)


def _missing(mode: Mode, context: int) -> dict:
    return {
        "kind": "e2e",
        "model": LARGE,
        "mode": mode.mode,
        "level": mode.level,
        "context_tokens": context,
        "bandwidth_mbps": None,
        "reason": PEER_REFUSED,
    }


def _runs(cfg: SweepConfig, model: str, mode: Mode, context: int, e2e: bool) -> list[dict]:
    if mode.mode == "recompute":
        ttft_s = RECOMPUTE_S * context / 1000
        return [_run("e2e", model, mode, None, context, r, ttft_s) for r in range(cfg.repeats)]
    bits = BITS[model].get(mode.label) or ADAPTIVE_BITS[mode.label]
    nbytes = int(bits * ELEMENTS_PER_TOKEN[model] * context / 8)
    runs = []
    for repeat in range(cfg.repeats):
        for link in cfg.links_of(mode) if e2e else []:
            load_s = _load_s(nbytes, link, repeat) - DECODE_S * (mode.label == "raw")
            runs.append(
                _run(
                    "e2e",
                    model,
                    mode,
                    link,
                    context,
                    repeat,
                    load_s + QUESTION_S,
                    bytes=nbytes,
                    load_s=load_s,
                )
            )
        if mode.codec_name is None:
            continue  # the adaptive modes are measured end to end only
        sizes = dict(
            bits_per_element=bits,
            ratio_vs_fp16=16.0 / bits,
            ratio_vs_int8=BITS[model]["int8"] / bits,
        )
        for link in cfg.stream_links_of(mode):
            load_s = _load_s(nbytes, link or 20000.0, repeat)
            runs.append(
                _run(
                    "stream",
                    model,
                    mode,
                    link,
                    context,
                    repeat,
                    bytes=nbytes,
                    load_s=load_s,
                    **sizes,
                )
            )
    return runs


def _load_s(nbytes: int, link_mbps: float, repeat: int) -> float:
    """The bytes' time on the link, the decode, and a hundredth of a second per repeat."""
    return nbytes * 8 / (link_mbps * 1e6) + DECODE_S + 0.01 * repeat


def _run(kind, model, mode, link, context, repeat, ttft_s=None, **measures) -> dict:
    run = Run(
        kind=kind,
        model=model,
        mode=mode.mode,
        level=mode.level,
        bandwidth_mbps=link,
        context_tokens=context,
        repeat=repeat,
        ttft_s=ttft_s,
        e2e_s=ttft_s + 0.5 if ttft_s else None,
        transfer_s=measures.get("load_s"),
        decode_s=DECODE_S if mode.moves_kv else None,
        **measures,
    )
    return run.to_dict()


def _quality(model: str, label: str) -> dict:
    mode = Mode.parse(label)
    return {
        "model": model,
        "mode": mode.mode,
        "level": mode.level,
        "codec": mode.mode,
        "context_tokens": 1024,
        "windows": 4,
        "bits_per_element": BITS[model][label],
        "ppl_change_pct": PPL[model][label],
        "top1_agreement": 1.0 - abs(PPL[model][label]) / 100,
        "kl": None,
    }
