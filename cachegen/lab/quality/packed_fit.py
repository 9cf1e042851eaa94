"""Which calibrated allocations fit a store that holds a level coded *and* packed.

The connector stores its default level twice: entropy-coded (the smallest form) and packed
(the same symbols at a fixed width per layer and K/V, decoded at memory speed). Both must fit
the storage budget together, so a default level is chosen on coded + packed bits.

``python -m cachegen.lab.quality.packed_fit rank CALIBRATION_JSON [--budget 7.95] [--out F]``
ranks the verified trials of a calibration (``cachegen calibrate --out``) by their
calibration-split perplexity change (``--by kl``: KL) among those whose estimated coded + packed
bits fit.

``python -m cachegen.lab.quality.packed_fit verify --model M --candidates FILE --like CAL
--out F`` verifies hand-written allocations (``QuantConfig`` dicts in a
``cachegen-packed-candidates`` document) on the calibration windows of the earlier calibration
CAL (its windows, seed and lengths), and writes them as a calibration document whose trials
``rank`` (and ``cachegen calibrate --trials``) read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from cachegen.codec import QuantConfig
from cachegen.codec.packed import symbol_width
from cachegen.codec.quant import num_scales
from cachegen.constants import CHUNK_TOKENS
from cachegen.fileio import check_version, versioned, write_atomic

SCHEMA = "cachegen-packed-fit"
CANDIDATES_SCHEMA = "cachegen-packed-candidates"  # verify's input: {"candidates": [config]}
VERSION = 1
# Coded + packed bits/element: half of bf16's 16 bits, less the connector's headroom for what
# the estimates leave out (cachegen.connector.transport.LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS).
BUDGET_BITS = 7.95
SCALE_BITS = 16  # scales are stored as fp16


def packed_bits(
    config: QuantConfig, heads: int, head_dim: int, chunk_tokens: int = CHUNK_TOKENS
) -> float:
    """Bits/element of ``config``'s packed form for a chunk of ``chunk_tokens`` tokens: each
    (layer, K/V)'s symbol width, the scales and (as in a sequence's first chunk) the exactly
    stored tokens in bf16, which the packed form stores like the coded one."""
    L = config.num_layers
    widths = sum(symbol_width(b) for b in (*config.key_bins, *config.value_bins))
    elements = 2 * L * heads * head_dim * chunk_tokens
    scales = sum(
        num_scales(config.scale(kind), L, heads, chunk_tokens, head_dim) for kind in ("k", "v")
    )
    exact = min(config.exact_tokens, chunk_tokens) * 2 * L * heads * head_dim
    return widths / (2 * L) + (SCALE_BITS * scales + 16 * exact) / elements


def rank(document: dict, budget: float = BUDGET_BITS, by: str = "ppl") -> list[dict]:
    """The verified trials of a calibration document with their coded (the calibration's
    estimate) and packed bits, those within ``budget`` first, each group by ``by``: perplexity
    change (``ppl``) or KL (``kl``, steadier on few windows)."""
    from cachegen.models import kv_geometry, resolve

    geometry = kv_geometry(resolve(document["model"]["name"]).config)
    rows = []
    for trial in document["trials"]:
        config = QuantConfig.from_dict(trial["config"])
        packed = packed_bits(config, geometry["num_kv_heads"], geometry["head_dim"])
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
    from cachegen.lab.quality.calibrate import (
        CalibrationSettings,
        CalibrationWindows,
        Trial,
        _verify,
    )
    from cachegen.lab.quality.simulate import quantize_kv

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


def _read(path: Path, schema: str = "cachegen-calibration") -> dict:
    return check_version(json.loads(path.read_text()), schema, (1,), str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cachegen.lab.quality.packed_fit")
    actions = parser.add_subparsers(dest="action", required=True)
    r = actions.add_parser("rank", help="rank a calibration's trials by coded + packed fit")
    r.add_argument("calibration", type=Path)
    r.add_argument("--budget", type=float, default=BUDGET_BITS)
    r.add_argument("--by", choices=("ppl", "kl"), default="ppl")
    r.add_argument("--top", type=int, default=10)
    r.add_argument("--out", type=Path)
    v = actions.add_parser("verify", help="verify candidate allocations on calibration windows")
    v.add_argument("--model", required=True)
    v.add_argument("--candidates", type=Path, required=True)
    v.add_argument("--like", type=Path, required=True, help="the calibration whose windows to use")
    v.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.action == "verify":
        earlier = _read(args.like)
        candidates = _read(args.candidates, CANDIDATES_SCHEMA)["candidates"]
        document = verify(args.model, candidates, earlier)
        write_atomic(args.out, (json.dumps(document, indent=1) + "\n").encode())
        return 0
    rows = rank(_read(args.calibration), args.budget, args.by)
    for row in rows[: args.top]:
        c = row["config"]
        print(
            f"ppl {row['ppl_change_pct']:+7.2f}%  KL {row['kl']:.4f}  "
            f"coded {row['coded_bits']:.2f} + packed "
            f"{row['packed_bits']:.2f} = {row['coded_plus_packed_bits']:.2f}"
            f"{'' if row['fits'] else ' (over)'}  hadamard {c['hadamard']} scales "
            f"{c['key_scale']}/{c['value_scale']} key bins {sorted(set(c['key_bins']))} "
            f"value bins {sorted(set(c['value_bins']))}"
        )
    if args.out:
        body = {
            "calibration": str(args.calibration),
            "budget_bits": args.budget,
            "by": args.by,
            "rows": rows,
        }
        write_atomic(
            args.out, (json.dumps(versioned(SCHEMA, VERSION, body), indent=1) + "\n").encode()
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
