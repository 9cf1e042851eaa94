"""The measurements behind docs/codec.md.

    cachegen codec-report --write docs/codec.md                                    # sizes
    pytest benchmarks/micro/test_codec_speed.py --benchmark-only --benchmark-json=speed.json
    cachegen codec-report --skip-sizes --benchmark-json speed.json --write docs/codec.md

Sizes: SmolLM2 KV of Python documentation text (``pydoc_data.topics`` without the codec's
calibration topics), cut into windows, every window encoded chunk by chunk into one
bitstream per chunk, as the streaming path stores it; every byte counted. Reconstruction
error is reported as SNR (signal-to-noise ratio of the decoded K and V, in dB). The peer
codecs (``PEER_CODECS``: LMCache's, run through LMCache's own code) are measured on the same
chunks, each chunk's bitstream holding one frame per LMCache chunk. Speed: the
pytest-benchmark JSON of ``benchmarks/micro/test_codec_speed.py`` (the peers' encode and
decode among its cases).

The asv suite (``benchmarks/codec.py``) and the micro-benchmarks measure on the same KV
(``text_windows``) and take sizes from the same functions (``measure``, ``size_stats``,
``coder_overhead``); so does the sweep's ``stream`` part (``size_stats``).

``--write FILE`` replaces the text between ``<!-- codec-report:NAME:begin -->`` and
``<!-- codec-report:NAME:end -->`` markers in FILE; without it the tables go to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch

from cachegen import models, workload
from cachegen.codec.api import decode, get_codec, inspect
from cachegen.codec.cachegen.codec import CacheGenCodec
from cachegen.codec.cachegen.profile import Profile
from cachegen.codec.cachegen.quant import QuantConfig, alphabet_size, paper_levels
from cachegen.codec.coding import rans
from cachegen.errors import InputError
from cachegen.kv import KVCache
from cachegen.profiles import ensure_profile, transient_profile
from cachegen_lab.codecs import PEER_CODECS

BASELINES = ["raw", "int8", "fp8", "int8-zstd", "kivi2"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=models.EMBEDDED_DEFAULT)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per text window (default 1024)")
    p.add_argument("--windows", type=int, default=2, help="text windows (default 2)")
    p.add_argument(
        "--chunk-tokens", type=int, default=256, help="tokens per bitstream (default 256)"
    )
    p.add_argument(
        "--benchmark-json",
        type=Path,
        action="append",
        help="pytest-benchmark JSON of benchmarks/micro/test_codec_speed.py (repeatable)",
    )
    p.add_argument("--skip-sizes", action="store_true", help="only format the speed table")
    p.add_argument("--write", type=Path, help="update the marked blocks of this markdown file")


def text_windows(model: str, tokens: int, windows: int) -> list[KVCache]:
    """KV of ``windows`` windows of ``tokens`` tokens of the workload's eval split, spread
    over the text (the first one starts at its beginning)."""
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, _ = load_model(model)
    ids = torch.tensor(tokenizer(workload.text("eval"))["input_ids"], dtype=torch.int64)
    if ids.numel() < tokens * windows:
        raise InputError(
            f"the report text has {ids.numel()} tokens, fewer than {windows} windows of {tokens}"
        )
    step = ids.numel() // windows
    return [extract_kv(model, token_ids=ids[i * step : i * step + tokens]) for i in range(windows)]


def variants(base: dict[int, QuantConfig]) -> dict[str, QuantConfig]:
    """Configs beyond the paper's presets, measured next to them."""
    l2, l3 = base[2], base[3]
    return {
        "level 2 bins, scale per token and head": dataclasses.replace(
            l2, key_scale="token-head", value_scale="token-head"
        ),
        "level 2 bins, keys per channel, values per token and head": dataclasses.replace(
            l2, key_scale="channel", value_scale="token-head"
        ),
        "level 2 + Hadamard rotation": dataclasses.replace(l2, hadamard=True),
        "level 2 + token locality (groups of 10)": dataclasses.replace(l2, group_size=10),
        "level 3 + token locality (groups of 10)": dataclasses.replace(l3, group_size=10),
    }


def _snr(x: torch.Tensor, y: torch.Tensor) -> float:
    noise = ((x - y) ** 2).sum().item()
    return float("inf") if noise == 0 else 10 * np.log10((x**2).sum().item() / noise)


def size_stats(blobs: list[bytes]) -> dict:
    """Size of one KV's bitstreams (one per chunk), every byte counted: ``bytes``,
    ``bits_per_element`` and the ratios against 16-bit floats and the ``int8`` codec."""
    total = elements = int8_bytes = 0
    for blob in blobs:
        info = inspect(blob)
        total += info["bytes"]
        shape = [info[k] for k in ("num_layers", "num_kv_heads", "head_dim", "num_tokens")]
        elements += 2 * math.prod(shape)  # K and V
        int8_bytes += info["bytes"] * info["ratio_vs_int8"]
    return {
        "bytes": total,
        "bits_per_element": total * 8 / elements,
        "ratio_vs_fp16": elements * 2 / total,
        "ratio_vs_int8": int8_bytes / total,
    }


def measure(codec, level: int, windows: list[KVCache], chunk_tokens: int) -> dict:
    """Size (:func:`size_stats`) and reconstruction SNR of ``codec`` at ``level`` on
    ``windows``, each encoded chunk by chunk and decoded back."""
    blobs = []
    ks, vs, kd, vd = [], [], [], []
    for kv in windows:
        for chunk in kv.chunks(chunk_tokens):
            blob = codec.encode(chunk, level)
            blobs.append(blob)
            out = decode(blob, out_dtype=torch.float32)
            ks.append(chunk.keys.float())
            vs.append(chunk.values.float())
            kd.append(out.keys)
            vd.append(out.values)
    k, v = torch.cat(ks, 2), torch.cat(vs, 2)
    return {
        **size_stats(blobs),
        "key_snr_db": _snr(k, torch.cat(kd, 2)),
        "value_snr_db": _snr(v, torch.cat(vd, 2)),
    }


def coder_overhead(profile: Profile, level: int, windows: list[KVCache], chunk_tokens: int) -> dict:
    """Coded stream size vs the ideal code length of the same symbols under the same tables."""
    from cachegen.codec.cachegen.encode import encode_chunk, exact_bytes
    from cachegen.codec.cachegen.quant import quantize_chunk

    tables = profile.tables(level)
    C = tables.num_channels
    coded = ideal = 0.0
    for kv in windows:
        for chunk in kv.chunks(chunk_tokens):
            body = encode_chunk(chunk, tables)
            L = chunk.num_layers
            for k, kind in enumerate("kv"):
                x = (chunk.keys if kind == "k" else chunk.values).float()
                for s, seg in enumerate(quantize_chunk(x, tables.config, kind, chunk.start)):
                    sym = seg.symbols.permute(0, 1, 3, 2).reshape(L, C, -1).numpy()
                    for layer in range(L):
                        rows = tables.base(layer, k, s) + np.arange(C)
                        ideal += rans.code_length_bits(tables.freq, rows, sym[layer])
            scale_bytes = sum(
                seg.scales.numel() * 2
                for kind in "kv"
                for seg in quantize_chunk(
                    (chunk.keys if kind == "k" else chunk.values).float(),
                    tables.config,
                    kind,
                    chunk.start,
                )
            )
            num_streams = L * 2 * tables.num_segments
            coded += (
                len(body) - exact_bytes(chunk, tables.config) - scale_bytes - 4 * num_streams
            ) * 8
    return {"coded_bits": coded, "ideal_bits": ideal, "overhead_percent": 100 * (coded / ideal - 1)}


def reference_rows(kvs: list[KVCache], chunk_tokens: int) -> list[tuple[str, str, str, dict]]:
    """The size table's rows of the baselines, then of the peer codecs (frames of LMCache's
    chunk, their default, inside each ``chunk_tokens`` bitstream)."""
    rows = []
    for name in BASELINES:
        codec = get_codec(name, chunk_tokens=chunk_tokens)
        rows.append((name, "-", "", measure(codec, 0, kvs, chunk_tokens)))
    for name in PEER_CODECS:
        peer = measure(get_codec(name), 0, kvs, chunk_tokens)
        rows.append((name, "-", "peer: LMCache's own code", peer))
    return rows


def sizes_table(model: str, tokens: int, windows: int, chunk_tokens: int) -> str:
    spec = models.resolve(model)
    profile = ensure_profile(spec)
    kvs = text_windows(model, tokens, windows)
    rows = reference_rows(kvs, chunk_tokens)
    codec = CacheGenCodec(profile=profile, chunk_tokens=chunk_tokens)
    for level in codec.levels:
        cfg = profile.config(level)
        rows.append(
            (
                "cachegen",
                str(level),
                cfg.description or _describe(cfg),
                measure(codec, level, kvs, chunk_tokens),
            )
        )
    # Variants are measured through a transient profile: nothing is added to the stored one.
    extra = variants(paper_levels(profile.model.num_layers))
    trial = transient_profile(spec, {1000 + i: cfg for i, cfg in enumerate(extra.values())})
    trial_codec = CacheGenCodec(profile=trial, chunk_tokens=chunk_tokens)
    for i, label in enumerate(extra):
        rows.append(
            ("cachegen", "variant", label, measure(trial_codec, 1000 + i, kvs, chunk_tokens))
        )

    n_tokens = sum(kv.num_tokens for kv in kvs)
    lines = [
        f"Model `{model}`, {windows} windows of {tokens} tokens of the workload's eval split "
        f"(no text shared with calibration), one bitstream per {chunk_tokens}-token chunk "
        f"({n_tokens} tokens in all); every byte counted (headers, token ids, scales, payload). "
        "SNR = 10 log10(signal energy / error energy) of the decoded keys and values. "
        f"The peers ({', '.join(PEER_CODECS)}) run LMCache's own code, one frame per "
        "LMCache chunk (third_party/lmcache/README.md).",
        "",
        "| codec | level | scheme | bits/element | ratio vs fp16 | ratio vs int8 | key SNR (dB) "
        "| value SNR (dB) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, level, label, m in rows:
        lines.append(
            f"| {name} | {level} | {label} | {m['bits_per_element']:.3f} "
            f"| {m['ratio_vs_fp16']:.2f}x | "
            f"{m['ratio_vs_int8']:.2f}x | {_db(m['key_snr_db'])} | {_db(m['value_snr_db'])} |"
        )
    lines += ["", "Entropy coder efficiency and the cost of tables (cachegen levels):", ""]
    lines += [
        "| level | coded payload vs ideal code length | profile tables (once per model) "
        "| tables if sent with every chunk |",
        "| --- | ---: | ---: | ---: |",
    ]
    for level in codec.levels:
        o = coder_overhead(profile, level, kvs, chunk_tokens)
        tables = profile.tables(level)
        cfg = tables.config
        # The public implementation ships an int16 CDF (alphabet + 1 entries) per channel with
        # every chunk.
        per_chunk = sum(
            2 * (alphabet_size(b) + 1) * tables.num_channels for b in cfg.key_bins + cfg.value_bins
        )
        per_chunk_bits = (
            per_chunk * 8 / (2 * spec.identity().num_layers * tables.num_channels * chunk_tokens)
        )
        lines.append(
            f"| {level} | +{o['overhead_percent']:.2f}% | {tables.freq.size * 2 / 1e6:.2f} MB | "
            f"{per_chunk / 1e6:.2f} MB per chunk (+{per_chunk_bits:.2f} bits/element) |"
        )
    return "\n".join(lines)


def _describe(cfg: QuantConfig) -> str:
    parts = [
        f"K bins {sorted(set(cfg.key_bins))}, V bins {sorted(set(cfg.value_bins))}",
        f"K scale {cfg.key_scale}",
        f"V scale {cfg.value_scale}",
    ]
    if cfg.hadamard:
        parts.append("Hadamard")
    if cfg.group_size:
        parts.append(f"locality {cfg.group_size}")
    if cfg.derotates:
        parts.append("pre-RoPE keys")
    if cfg.exact_tokens:
        parts.append(f"first {cfg.exact_tokens} token(s) exact")
    return ", ".join(parts)


def _db(value: float) -> str:
    return "exact" if value == float("inf") else f"{value:.1f}"


TIMERS = {
    "perf_counter": "wall clock (`time.perf_counter`)",
    "process_time": "CPU time of all threads (`time.process_time`): elements per CPU-second, "
    "i.e. per busy core",
}


def speed_table(paths: list[Path]) -> str:
    """Format pytest-benchmark JSON files: elements per second from the minimum and median times."""
    out = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
            benches = data["benchmarks"]
        except (OSError, ValueError, KeyError) as exc:
            raise InputError(f"{path} is not a pytest-benchmark JSON file: {exc}") from exc
        machine = data.get("machine_info", {})
        timer = (benches[0].get("options", {}).get("timer", "") if benches else "").split(".")[-1]
        out += [
            f"Timer: {TIMERS.get(timer, timer)}. "
            f"Machine: {machine.get('cpu', {}).get('brand_raw', '?')}, "
            f"{machine.get('cpu', {}).get('count', '?')} CPUs, {data.get('datetime', '')[:16]}. "
            "Elements are KV elements (symbols for the bare coders); M = 10^6 per second.",
            "",
            "| benchmark | what | elements | min time (ms) | M elements/s (best) "
            "| M elements/s (median) | bits/symbol |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for b in sorted(benches, key=lambda b: (b.get("group") or "", b["name"])):
            info = b.get("extra_info", {})
            n = info.get("elements")
            if not n:
                continue
            st = b["stats"]
            out.append(
                f"| {b['name'].removeprefix('test_')} | {info.get('what', '')} | {n:,} "
                f"| {st['min'] * 1e3:.1f} | "
                f"{n / st['min'] / 1e6:.0f} | {n / st['median'] / 1e6:.0f} | "
                + (f"{info['bits_per_symbol']:.3f} |" if "bits_per_symbol" in info else "|")
            )
        out.append("")
    return "\n".join(out).rstrip()


def _replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(
        rf"(<!-- codec-report:{name}:begin -->\n).*?(\n<!-- codec-report:{name}:end -->)", re.S
    )
    if not pattern.search(text):
        raise InputError(f"no <!-- codec-report:{name}:begin/end --> markers in the file")
    return pattern.sub(lambda m: m.group(1) + body + m.group(2), text)


def run(args: argparse.Namespace) -> int:
    blocks = {}
    if not args.skip_sizes:
        blocks["sizes"] = sizes_table(args.model, args.tokens, args.windows, args.chunk_tokens)
    if args.benchmark_json:
        blocks["speed"] = speed_table(args.benchmark_json)
    if args.write:
        text = args.write.read_text()
        for name, body in blocks.items():
            text = _replace_block(text, name, body)
        args.write.write_text(text)
        print(f"updated {', '.join(blocks)} in {args.write}", file=sys.stderr)
    else:
        for body in blocks.values():
            print(body + "\n")
    return 0
