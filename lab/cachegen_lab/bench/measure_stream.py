"""Codec and link measurements without vLLM: bytes, ratios, encode, transfer and decode time.

The stream bench's steps (``cachegen_lab.bench.stream_bench``) on the sweep's contexts: per
context the model's KV is extracted once (transformers); per mode its chunks are encoded
into a local store (``prepare``), decoded twice to warm up (``warm_up``), and loaded back
at each of the sweep's stream bandwidths (``stream_links_of``) through a real TCP socket on
loopback paced by the configured shaper (the ``unlimited`` link: the same socket, unpaced),
fetching and decoding pipelined, every chunk checked against its tokens (``run_load``).
Each load's ``StreamRow`` becomes a results ``Run`` with the encoding's sizes
(``codec_report.size_stats``).

The adaptive modes have no fixed size and are measured end to end only (``measure_e2e``);
text recompute moves no KV. Each context gets the model's modes measured at its length
(``SweepConfig.modes_at``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from cachegen.errors import CacheGenError
from cachegen.modes import Mode, configured_form
from cachegen_lab.bench import stream_bench
from cachegen_lab.bench.codec_report import size_stats
from cachegen_lab.bench.prompts import Context
from cachegen_lab.rows import Run

PREFILL_CHUNK_TOKENS = 512  # bounds the memory of the KV extraction


def stream_modes(modes: list[Mode]) -> list[Mode]:
    return [m for m in modes if m.codec_name is not None]


def measure_stream(
    cfg, model: str, contexts: list[Context], *, runs: list, missing: list, tick
) -> None:
    from cachegen import models
    from cachegen.extract import extract_kv
    from cachegen.store import open_store

    measured = {c.tokens: stream_modes(cfg.modes_at(model, c.tokens)) for c in contexts}
    if not any(measured.values()):
        return
    spec = models.resolve(model)
    with tempfile.TemporaryDirectory(prefix="cachegen-bench-stream-") as root:
        store = open_store(Path(root).as_uri())
        try:
            for context in contexts:
                modes = measured[context.tokens]
                if not modes:
                    continue
                ids = torch.tensor(context.ids)
                kv = extract_kv(spec, token_ids=ids, prefill_chunk_tokens=PREFILL_CHUNK_TOKENS)
                for mode in modes:
                    try:
                        runs.extend(_measure_mode(cfg, store, model, ids, kv, context, mode))
                    except CacheGenError as exc:
                        missing.append(
                            {
                                "kind": "stream",
                                "model": model,
                                "mode": mode.mode,
                                "level": mode.level,
                                "context_tokens": context.tokens,
                                "bandwidth_mbps": None,
                                "reason": f"{type(exc).__name__}: {exc}",
                            }
                        )
                    tick()
        finally:
            store.close()


def _measure_mode(cfg, store, model: str, ids, kv, context: Context, mode: Mode) -> list[dict]:
    from cachegen.profiles import codec_for

    level = codec_for(mode.codec_name, model).resolve_level(mode.level)
    form = configured_form(level, mode.codec_name)
    prep = stream_bench.prepare(
        store, model, mode.codec_name, ids, cfg.chunk_tokens, [form], kv=kv, log=lambda msg: None
    )
    sizes = size_stats([store.read(record) for record in prep.records(form)])
    stream_bench.warm_up(store, prep)
    rows = []
    for bandwidth in cfg.stream_links_of(mode):  # None: the unlimited link
        for repeat in range(cfg.repeats):
            stats, link = stream_bench.run_load(
                store, prep, shaper=cfg.shaper, bandwidth=bandwidth, rtt_ms=0.0, form=form
            )
            row = stream_bench.load_row(stats, link, prep, level, prep.prefill_tps)
            run = Run.of(
                row,
                kind="stream",
                mode=mode.mode,
                level=mode.level,
                context_tokens=context.tokens,
                repeat=repeat,
                bits_per_element=sizes["bits_per_element"],
                ratio_vs_fp16=sizes["ratio_vs_fp16"],
                ratio_vs_int8=sizes["ratio_vs_int8"],
                encode_s=prep.encode_s.get(form),  # None: the store had them
            )
            rows.append(run.to_dict())
    return rows
