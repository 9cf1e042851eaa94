"""Which calibrated allocations fit a store that holds a level coded *and* packed.

The connector stores its default level twice: entropy-coded (the smallest form) and packed
(the same symbols at a fixed width per layer and K/V, decoded at memory speed). Both must fit
the storage budget together, so a default level is chosen on coded + packed bits.

``cachegen experiment packed-fit rank CALIBRATION_JSON [--budget BITS] [--out F]``
ranks the verified trials of a calibration (``cachegen calibrate --out``) by their
calibration-split perplexity change (``--by kl``: KL) among those whose estimated coded + packed
bits fit.

``cachegen experiment packed-fit verify --model M --candidates FILE --like CAL
--out F`` verifies hand-written allocations (``QuantConfig`` dicts in a
``cachegen-packed-candidates`` document) on the calibration windows of the earlier calibration
CAL (its windows, seed and lengths), and writes them as a calibration document whose trials
``rank`` (and ``cachegen calibrate --trials``) read.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from cachegen.codec import QuantConfig
from cachegen.codec.cachegen.size import packed_bits
from cachegen.connector.ladder import LADDER_BUDGET_BITS, LADDER_HEADROOM_BITS
from cachegen.constants import CHUNK_TOKENS
from cachegen.fileio import check_version

SCHEMA = "cachegen-packed-fit"
CANDIDATES_SCHEMA = "cachegen-packed-candidates"  # verify's input: {"candidates": [config]}
VERSION = 1
# Coded + packed bits/element: the connector's storage budget for its ladder.
BUDGET_BITS = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS


def rank(document: dict, budget: float = BUDGET_BITS, by: str = "ppl") -> list[dict]:
    """The verified trials of a calibration document with their coded (the calibration's
    estimate) and packed bits, those within ``budget`` first, each group by ``by``: perplexity
    change (``ppl``) or KL (``kl``, steadier on few windows)."""
    from cachegen.models import kv_geometry, resolve

    geometry = kv_geometry(resolve(document["model"]["name"]).config)
    rows = []
    for trial in document["trials"]:
        config = QuantConfig.from_dict(trial["config"])
        packed = packed_bits(config, geometry["num_kv_heads"], geometry["head_dim"], CHUNK_TOKENS)
        coded = float(trial["est_bits_per_element"])
        rows.append(
            {
                "coded_bits": coded,
                "packed_bits": packed,
                "coded_plus_packed_bits": coded + packed,
                "fits": coded + packed <= budget,
                "ppl_change_pct": trial["ppl_change_pct"],
                "kl": trial["kl"],
                "config": trial["config"],
            }
        )
    order = (lambda r: r["kl"]) if by == "kl" else (lambda r: abs(r["ppl_change_pct"]))
    return sorted(rows, key=lambda r: (not r["fits"], order(r)))


def verify(model: str, candidates: list[dict], earlier: dict) -> dict:
    """A calibration document (``earlier``'s settings and sensitivities) whose trials are
    ``candidates``, measured on ``earlier``'s calibration windows."""
    from cachegen_lab.quality.calibrate import (
        CalibrationSettings,
        CalibrationWindows,
        Trial,
        _verify,
    )
    from cachegen_lab.quality.simulate import quantize_kv

    settings = CalibrationSettings(
        windows=int(earlier["windows"]),
        context_tokens=int(earlier["context_tokens"]),
        continuation_tokens=int(earlier["continuation_tokens"]),
        seed=int(earlier.get("seed", 0)),
        exact_tokens=int(earlier.get("exact_tokens", 0)),
    )
    data = CalibrationWindows(model, settings, progress=sys.stderr.isatty())
    trials = []
    for candidate in candidates:
        config = QuantConfig.from_dict(candidate)
        bits = elements = 0.0
        for kv, _, _ in data.items[: settings.stats_windows]:  # the calibration's estimate
            bits += quantize_kv(kv, config, settings.chunk_tokens)[1]
            elements += kv.num_elements
        trials.append(Trial(config, bits / elements, math.nan))
    _verify(data, trials, "verify candidates", settings)
    return {**earlier, "choices": [], "trials": [t.to_dict() for t in trials]}


def read_document(path: Path, schema: str = "cachegen-calibration") -> dict:
    """A calibration document (or, with ``schema``, another) as :func:`rank` and :func:`verify`
    read it."""
    return check_version(json.loads(path.read_text()), schema, (1,), str(path))
