"""Where the ``tcq`` codec's gains come from: its transform against its component weights.

Four tcq models of one model, all fitted on the ``calibrate`` split for the same levels (the
same calibration bits per element), differ in two parts only:

* ``both``: tcq as shipped (the KVTC PCA basis, each component's step ``step / sqrt(w_i)``
  with ``w_i`` its output weight);
* ``transform``: the PCA basis, every weight 1 (one step for every component);
* ``weights``: no transform (the identity basis: each component is one channel, after the
  same channel mean the PCA basis subtracts), weights computed for the channels;
* ``neither``: identity basis, every weight 1 (a per-channel entropy-coded uniform quantizer).

The variants live in memory only: neither the transforms directory nor the model's tcq
reference sees them. Each is evaluated by ``cachegen eval``'s machinery
(:func:`cachegen_lab.quality.evaluate.evaluate`) on held-out windows; besides its rows the
result says, per variant and level, how many bits per element each layer's keys and values
took (from the decoder's per-layer byte counts). Run::

    cachegen experiment tcq-ablation --model smollm2-135m --dataset prose,code \\
        --windows 8 --context-tokens 512 --levels 21,23,25 --json OUT.json
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from cachegen.codec.coding.bitstream import parse_frames, parse_header
from cachegen.codec.tcq import codec as tcq
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.transform.basis import TransformBasis
from cachegen.errors import InputError
from cachegen.fileio import versioned
from cachegen.kv import KVCache
from cachegen_lab.quality.evaluate import Candidate, EvalSettings, evaluate

SCHEMA = "cachegen-tcq-ablation"
VERSION = 1
# variant -> (PCA basis, output weights)
VARIANTS: dict[str, tuple[bool, bool]] = {
    "both": (True, True),
    "transform": (True, False),
    "weights": (False, True),
    "neither": (False, False),
}


def identity_basis(basis: TransformBasis) -> TransformBasis:
    """``basis`` with every component one channel: the same channel mean, each channel's
    variance (the PCA's variances mapped back to the channels)."""
    components = basis.components.astype(np.float64)
    variances = np.einsum("lkic,lki->lkc", components**2, basis.variances.astype(np.float64))
    eye = np.eye(components.shape[-1], dtype=np.float32)
    return replace(
        basis,
        calibration={**basis.calibration, "components": "identity"},
        components=np.broadcast_to(eye, components.shape).copy(),
        variances=variances.astype(np.float32),
    )


def fit_variants(model: str, level_ids: list[int]) -> dict[str, tcq_model.TcqModel]:
    """The four variants' tcq models for ``level_ids`` (``both``: the shipped model, whose
    levels are fitted alike; the others in memory)."""
    from cachegen import models
    from cachegen.fitting.kvtc import ensure_kvtc_basis
    from cachegen.fitting.tcq import ensure_tcq_model, fit_tcq_model

    unknown = [level for level in level_ids if level not in tcq_model.LEVELS]
    if unknown or not level_ids:
        raise InputError(
            f"--levels must name tcq levels ({', '.join(map(str, tcq_model.LEVELS))}), got "
            f"{', '.join(map(str, level_ids)) or 'none'}"
        )
    spec = models.resolve(model)
    pca = ensure_kvtc_basis(spec)
    levels = {level: tcq_model.LEVELS[level] for level in sorted(level_ids)}
    out = {}
    for name, (transform, weighted) in VARIANTS.items():
        if transform and weighted:
            out[name] = ensure_tcq_model(spec)
            continue
        basis = pca if transform else identity_basis(pca)
        out[name] = fit_tcq_model(spec, levels, basis=basis, unit_weights=not weighted)
    return out


@dataclass
class LayerBytes:
    """Bytes of each (layer, K/V) stream over every round trip, and the elements they hold."""

    bytes: np.ndarray  # [L, 2]
    elements: float = 0.0  # per (layer, K/V)

    def bits_per_element(self) -> list[list[float]]:
        return (8 * self.bytes / max(self.elements, 1.0)).round(4).tolist()


def roundtrip(model: tcq_model.TcqModel, level: int, tally: LayerBytes):
    """Encode and decode with ``model`` held in memory (the decoder is built around it, not
    looked up by id); each stream's bytes go into ``tally``."""
    codec = tcq.TcqCodec(tcq=model)

    def run(kv: KVCache) -> tuple[KVCache, float]:
        blob = codec.encode(kv, level=level)
        header = parse_header(blob)
        frames = parse_frames(blob, header)
        decoder = tcq.decoder_with(header, model)
        for frame in frames:
            tally.bytes += decoder.layer_bytes(frame)
        tally.elements += kv.num_elements / (2 * header.num_layers)
        out = decoder.decode(frames, torch.bfloat16)
        decoded = KVCache(
            keys=out[0],
            values=out[1],
            token_ids=torch.from_numpy(np.concatenate([f.token_ids for f in frames])),
            model=header.model,
            start=header.start,
            layers=header.layers,
        )
        return decoded, 8.0 * len(blob)

    return run


def describe(name: str, model: tcq_model.TcqModel) -> dict:
    transform, weighted = VARIANTS[name]
    return {
        "model_file": model.id,
        "basis": "pca" if transform else "identity (channel mean subtracted)",
        "weights": "output" if weighted else "1",
        "steps": {str(level): list(steps) for level, steps in model.levels.items()},
    }


def run_ablation(
    model: str,
    datasets: list[str],
    level_ids: list[int],
    windows: int,
    context_tokens: int,
    continuation_tokens: int,
    seed: int,
    command: str,
    progress: bool = True,
    split: str = "eval",
) -> dict:
    from cachegen.extract import load_model
    from cachegen_lab.quality.datasets import DataSettings, load_windows

    _, tokenizer, spec = load_model(model)
    data = [
        DataSettings(dataset, windows, context_tokens, continuation_tokens, seed=seed, split=split)
        for dataset in datasets
    ]
    # every dataset's windows before the (slow) fits: a bad name fails at once
    texts_of = [load_windows(one, tokenizer, spec.max_positions) for one in data]
    variants = fit_variants(model, level_ids)
    settings = EvalSettings(gen_windows=0, seed=seed)  # perplexity only: no generation
    rows = []
    for settings_data, texts in zip(data, texts_of):
        dataset = settings_data.dataset
        shape = (spec.identity().num_layers, 2)
        plan = [
            (name, level, LayerBytes(np.zeros(shape))) for name in VARIANTS for level in level_ids
        ]
        candidates = [
            Candidate("tcq", str(level), roundtrip(variants[name], level, tally), {"variant": name})
            for name, level, tally in plan
        ]
        labels = {"model": spec.name, "dataset": dataset}
        found = evaluate(model, texts, candidates, settings, progress=progress, labels=labels)
        for row, (name, level, tally) in zip(found, plan):
            row["variant"] = name
            row["calibration_bits_per_element"] = tcq_model.LEVELS[level]
            row["layer_bits_per_element"] = tally.bits_per_element()
            rows.append(row)
    return versioned(
        SCHEMA,
        VERSION,
        {
            "command": command,
            "model": spec.name,
            "levels": {str(level): tcq_model.LEVELS[level] for level in level_ids},
            "data": [settings_data.describe() for settings_data in data],
            "windows": windows,
            "variants": {name: describe(name, m) for name, m in variants.items()},
            "layer_bits_per_element": "per layer [keys, values] bits per element of its streams",
            "rows": rows,
        },
    )


def table(doc: dict) -> str:
    lines = ["dataset  variant    level  bits/elem  ppl change % [95% CI]"]
    for r in doc["rows"]:
        low, high = r["ppl_change_ci95"] or (float("nan"), float("nan"))
        lines.append(
            f"{r['dataset']:<8} {r['variant']:<10} {r['level']:>5}  {r['bits_per_element']:9.3f}"
            f"  {r['ppl_change_pct']:+.2f} [{low:+.2f}, {high:+.2f}]"
        )
    return "\n".join(lines)
