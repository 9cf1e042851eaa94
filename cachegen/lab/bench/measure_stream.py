"""Codec and link measurements without vLLM: bytes, ratios, encode, transfer and decode time.

For each context the model's KV is extracted once (transformers), cut into the connector's
chunks and encoded by each mode's codec, one bitstream per chunk as the connector stores
them. The chunks go into a local store and are loaded back through ``cachegen.stream``: a
real TCP socket on loopback paced by the configured shaper at each bandwidth, with fetching
and decoding pipelined, and every decoded chunk checked against the tokens it must hold.

Adaptive mode has no fixed size and is measured end to end only (``measure_e2e``); text
recompute moves no KV.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from cachegen.errors import CacheGenError
from cachegen.lab.bench.prompts import Context
from cachegen.modes import Mode
from cachegen.profiles import codec_for

PREFILL_CHUNK_TOKENS = 512  # bounds the memory of the KV extraction


def stream_modes(modes: list[Mode]) -> list[Mode]:
    return [m for m in modes if m.codec_name is not None]


def measure_stream(
    cfg, model: str, identity, contexts: list[Context], *, runs: list, missing: list, tick
) -> None:
    from cachegen import models
    from cachegen.extract import extract_kv

    modes = stream_modes(cfg.modes)
    if not modes:
        return
    spec = models.resolve(model)
    for context in contexts:
        kv = extract_kv(
            spec, token_ids=torch.tensor(context.ids), prefill_chunk_tokens=PREFILL_CHUNK_TOKENS
        )
        for mode in modes:
            try:
                runs.extend(_measure_mode(cfg, model, spec, kv, context, mode))
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


def _measure_mode(cfg, model: str, spec, kv, context: Context, mode: Mode) -> list[dict]:
    from cachegen.codec import decode, inspect
    from cachegen.store import chunk_keys, open_store
    from cachegen.stream.link import open_link
    from cachegen.stream.loader import stream_load

    codec = codec_for(mode.codec_name, spec, chunk_tokens=cfg.chunk_tokens)
    level = codec.resolve_level(mode.level)
    chunks = kv.chunks(cfg.chunk_tokens)
    begin = time.perf_counter()
    blobs = [codec.encode(chunk, level=level) for chunk in chunks]
    encode_s = time.perf_counter() - begin
    infos = [inspect(blob) for blob in blobs]
    nbytes = sum(len(b) for b in blobs)
    int8_bytes = sum(info["ratio_vs_int8"] * info["bytes"] for info in infos)
    expected = [chunk.token_ids for chunk in chunks]

    def consume(index: int, decoded) -> None:
        if not torch.equal(decoded.token_ids, expected[index]):
            raise CacheGenError(f"chunk {index} came back holding other tokens than were stored")

    rows = []
    with tempfile.TemporaryDirectory(prefix="cachegen-bench-stream-") as root:
        store = open_store(Path(root).as_uri())
        try:
            keys = chunk_keys(kv.model, codec.profile_id, kv.token_ids, cfg.chunk_tokens)
            for key, blob in zip(keys, blobs):
                store.put(key, level, blob)
            for blob in blobs[:1]:
                decode(blob)  # warm: first use loads tables and kernels
            for bandwidth in cfg.bandwidth_mbps:
                for repeat in range(cfg.repeats):
                    with open_link(store, bandwidth_mbps=bandwidth, shaper=cfg.shaper) as link:
                        stats = stream_load(
                            link.source,
                            keys,
                            decode,
                            consume,
                            level=level,
                            chunk_tokens=[c.num_tokens for c in chunks],
                        )
                    rows.append(
                        {
                            "kind": "stream",
                            "model": model,
                            "mode": mode.mode,
                            "level": mode.level,
                            "bandwidth_mbps": bandwidth,
                            "context_tokens": context.tokens,
                            "repeat": repeat,
                            "loaded_tokens": kv.num_tokens,
                            "ttft_s": None,
                            "e2e_s": None,
                            "tokens_per_s": None,
                            "bytes": nbytes,
                            "bits_per_element": nbytes * 8 / kv.num_elements,
                            "ratio_vs_fp16": kv.num_elements * 2 / nbytes,
                            "ratio_vs_int8": int8_bytes / nbytes,
                            "encode_s": encode_s,
                            "transfer_s": stats.transfer_s,
                            "decode_s": stats.decode_s,
                            "load_s": stats.load_s,
                            "goodput_mbps": stats.goodput_mbps,
                        }
                    )
        finally:
            store.close()
    return rows
