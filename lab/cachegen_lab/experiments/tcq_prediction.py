"""What tcq's cross-layer prediction saves: the bits per element of a model file's levels on
held-out windows with its predictor and without it, and that both decode to the same KV.

The model file is the one the codec uses (the shipped file of an embedded model, else the
machine's fitted one) plus a predictor fitted here on its own calibration coefficients
(``cachegen.fitting.tcq.with_predictor``); without its predictor it is that file (the same
quantizer and tables), so the quality measured for its levels holds with the predictor too.

The prediction (``cachegen.codec.tcq.predict``) changes which symbols a coded stream holds,
never the values they decode to, so a level's quality is the same with and without it; this
lab measures the size and checks the sameness, bit for bit, on every window and level. The
windows are those ``cachegen eval`` takes for the same domain, count, lengths and seed, so the
bits line up with its quality rows. Run::

    cachegen experiment tcq-prediction --model smollm2-135m --dataset prose,code \\
        --windows 16 --levels 22,23,24,25 --json OUT.json
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tqdm import tqdm

from cachegen.codec.coding.bitstream import parse_frames, parse_header
from cachegen.codec.tcq.codec import TcqCodec, decoder_with
from cachegen.codec.tcq.model import TcqModel
from cachegen.errors import InputError
from cachegen.fileio import versioned

SCHEMA = "cachegen-tcq-prediction"
VERSION = 2  # 2: the codec's own model file plus a predictor (base_model_file)


def without_predictor(model: TcqModel) -> TcqModel:
    """``model`` without its predictor: the same levels, coded without prediction."""
    return dataclasses.replace(
        model,
        predictor=np.zeros((0, 2, 0, 0), np.float16),
        predictor_shift=np.zeros((0, 0), np.uint8),
    )


def _decoded(blob: bytes, model: TcqModel) -> torch.Tensor:
    """``blob`` decoded with ``model`` held in memory (not looked up by id): [2, L, H, T, D]."""
    header = parse_header(blob)
    frames = parse_frames(blob, header)
    return decoder_with(header, model).decode(frames, torch.bfloat16)


def measure(model: TcqModel, levels: list[int], kvs, chunk_tokens: int, progress: bool) -> dict:
    """Per level: each window's bits per element with and without the predictor, and whether
    every window decoded alike."""
    models = (model, without_predictor(model))
    codecs = [TcqCodec(tcq=m, chunk_tokens=chunk_tokens) for m in models]
    rows = {level: {"predicted": [], "unpredicted": [], "decoded_alike": True} for level in levels}
    for kv in tqdm(kvs, desc="windows", disable=not progress):
        for level in levels:
            blobs = [codec.encode(kv, level) for codec in codecs]
            row = rows[level]
            row["predicted"].append(len(blobs[0]) * 8 / kv.num_elements)
            row["unpredicted"].append(len(blobs[1]) * 8 / kv.num_elements)
            same = torch.equal(*(_decoded(b, m) for b, m in zip(blobs, models)))
            row["decoded_alike"] = row["decoded_alike"] and same
    return {str(level): _summary(row) for level, row in rows.items()}


def _summary(row: dict) -> dict:
    predicted, unpredicted = np.array(row["predicted"]), np.array(row["unpredicted"])
    saved = 1 - predicted / unpredicted
    return {
        "bits_per_element": float(predicted.mean()),
        "unpredicted_bits_per_element": float(unpredicted.mean()),
        "saved_pct": float(100 * (1 - predicted.mean() / unpredicted.mean())),
        "saved_pct_min": float(100 * saved.min()),
        "saved_pct_max": float(100 * saved.max()),
        "decoded_alike": bool(row["decoded_alike"]),
        "windows": len(predicted),
    }


def run(
    model: str,
    datasets: list[str],
    windows: int,
    context_tokens: int,
    continuation_tokens: int,
    levels: list[int],
    seed: int,
    command: str,
    progress: bool = True,
) -> dict:
    from cachegen.constants import CHUNK_TOKENS
    from cachegen.extract import extract_kv, load_model
    from cachegen.fitting.tcq import with_predictor
    from cachegen.profiles import codec_for
    from cachegen_lab.quality.datasets import DataSettings, load_windows

    _, tokenizer, spec = load_model(model)
    base = codec_for("tcq", spec).tcq
    fitted = with_predictor(base, spec)
    unknown = sorted(set(levels) - set(fitted.levels))
    if unknown:
        raise InputError(f"--levels {unknown} are not levels of the model file {fitted.levels}")
    rows = []
    for dataset in datasets:
        settings = DataSettings(dataset, windows, context_tokens, continuation_tokens, seed=seed)
        texts = load_windows(settings, tokenizer, spec.max_positions)
        kvs = (extract_kv(spec, token_ids=w.context_ids) for w in texts)
        found = measure(fitted, levels, kvs, CHUNK_TOKENS, progress)
        rows.append({"dataset": dataset, "data": settings.describe(), "levels": found})
    return versioned(
        SCHEMA,
        VERSION,
        {
            "command": command,
            "model": spec.name,
            "model_file": fitted.id,
            "base_model_file": base.id,
            "chunk_tokens": CHUNK_TOKENS,
            "bits_per_element": "every byte of a window's bitstream over its KV elements, mean "
            "over windows; saved_pct: 1 - predicted / unpredicted means, with the range over "
            "windows",
            "rows": rows,
        },
    )


def table(doc: dict) -> str:
    lines = [f"{'dataset':<9} {'level':>5} {'bits':>7} {'without':>8} {'saved':>13} alike"]
    for row in doc["rows"]:
        for level, cell in row["levels"].items():
            saved = f"{cell['saved_pct']:.1f}% ({cell['saved_pct_min']:.1f}-"
            saved += f"{cell['saved_pct_max']:.1f})"
            lines.append(
                f"{row['dataset']:<9} {level:>5} {cell['bits_per_element']:>7.3f} "
                f"{cell['unpredicted_bits_per_element']:>8.3f} {saved:>13} "
                f"{'yes' if cell['decoded_alike'] else 'NO'}"
            )
    return "\n".join(lines)
