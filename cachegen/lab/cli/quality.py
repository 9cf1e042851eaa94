"""Quality subcommands: ``cachegen eval``, ``cachegen sweep`` and ``cachegen calibrate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachegen import models
from cachegen.errors import InputError


def _length_list(text: str) -> list[tuple[int, int | None]]:
    """``1024:40,2048`` -> [(1024, 40), (2048, None)] (None: as many as --windows)."""
    pairs = []
    try:
        for item in (x.strip() for x in text.split(",") if x.strip()):
            length, _, count = item.partition(":")
            pairs.append((int(length), int(count) if count else None))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected LENGTH[:SAMPLES],... e.g. 1024:40,2048:20, got {text!r}"
        ) from exc
    if not pairs or any(n < 1 or (k is not None and k < 1) for n, k in pairs):
        raise argparse.ArgumentTypeError(
            f"lengths and sample counts must be positive, got {text!r}"
        )
    return pairs


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc
    if not values:
        raise argparse.ArgumentTypeError("give at least one number")
    return values


def _data_args(p: argparse.ArgumentParser, windows: int) -> None:
    p.add_argument(
        "--model",
        default=models.EMBEDDED_DEFAULT,
        help="model name, hub id or directory (default: %(default)s)",
    )
    p.add_argument(
        "--dataset",
        default="pydoc",
        help="'pydoc' (CPython's documentation text), 'prose' (Sherlock Holmes stories), "
        "'code' (Python standard library source), 'dialogue' (Shakespeare's plays), all held "
        "out from calibration text; 'retrieval' (LongChat-style lines), 'passkey' (a 5-digit "
        "key hidden in filler text) or a path to a UTF-8 text or JSONL file "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--windows",
        type=int,
        default=windows,
        help="evaluation windows; for 'retrieval' and 'passkey' samples per context length "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        default=1024,
        help="tokens of context whose KV is compressed (default: %(default)s)",
    )
    p.add_argument(
        "--continuation-tokens",
        type=int,
        default=128,
        help="scored tokens after the context (default: %(default)s)",
    )
    p.add_argument(
        "--retrieval-lengths",
        type=_length_list,
        default=None,
        help="context lengths in tokens of the 'retrieval' and 'passkey' tasks, each optionally "
        "with its own sample count, "
        "e.g. 1024:40,2048:20,8064 (default: 1K doubling up to the model's limit, --windows "
        "samples each)",
    )
    p.add_argument(
        "--gen-tokens",
        type=int,
        default=64,
        help="greedy tokens per window for exact match/ROUGE-L/BLEU (default: %(default)s)",
    )
    p.add_argument(
        "--gen-windows",
        type=int,
        default=None,
        help="run greedy generation on the first N windows only (default: all)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed for window sampling and bootstrap (default: %(default)s)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="measure what a codec's levels cost in answer quality",
        description="Run MODEL on evaluation windows with the original KV of each context and "
        "with the KV after encode+decode by each codec level; report bits/element, perplexity "
        "change, top-1 agreement, KL, exact match/ROUGE-L/BLEU of greedy generations and (dataset "
        "'retrieval') retrieval accuracy.",
    )
    _data_args(p, windows=16)
    p.add_argument(
        "--codec",
        action="append",
        required=True,
        metavar="NAME[:LEVELS]",
        help="codec to evaluate (repeatable); NAME:1,2 picks its levels",
    )
    p.add_argument(
        "--levels",
        default="all",
        help="comma-separated levels for codecs given without their own (default: all)",
    )
    p.add_argument("--json", action="store_true", help="print the result rows as JSON")
    p.add_argument(
        "--out",
        type=Path,
        help="also write eval.json, eval.md and eval.png (rate-distortion plot) here",
    )
    p.set_defaults(func=_eval)

    p = subparsers.add_parser(
        "sweep",
        help="rate-distortion sweep over codecs, levels and codec options (JSON + PNG + Markdown)",
        description="Evaluate every baseline codec, every level of the model's cachegen profile "
        "and a grid of cachegen options on the same windows; write sweep.json, sweep.md and "
        "sweep.png (with the Pareto frontier of bits/element against each metric) into --out.",
    )
    _data_args(p, windows=256)
    p.set_defaults(gen_windows=32)
    p.add_argument(
        "--no-variants",
        action="store_true",
        help="only the codecs' own levels, no extra cachegen options",
    )
    p.add_argument(
        "--out", type=Path, required=True, help="directory for sweep.json, sweep.md and sweep.png"
    )
    p.add_argument(
        "--replot",
        action="store_true",
        help="do not measure: rewrite sweep.md and sweep.png from --out's sweep.json",
    )
    p.add_argument(
        "--update",
        type=Path,
        action="append",
        default=[],
        metavar="EVAL_JSON",
        help="with --replot: rows of this `cachegen eval --out` result (same data and windows) "
        "replace the sweep's rows of the same codec and level, or are added (repeatable)",
    )
    p.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="CODEC/LEVEL",
        help="with --replot: remove this row, e.g. a level the profile no longer has (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the result rows as JSON")
    p.set_defaults(func=_sweep)

    p = subparsers.add_parser(
        "calibrate",
        help="choose per-layer bins and codec options for a quality target; save them as a level",
        description="Measure each layer's sensitivity on the 'calibrate' split of the pydoc text, "
        "allocate bins and options for the fewest bits that keep the perplexity change within "
        "--target-ppl, verify on real runs and save the result as level --level of the model's "
        "cachegen profile. With --codec tcq: run every level of the model's tcq model on the "
        "same windows and record the cheapest level that meets each target (its loss for a "
        "quality bound; --set-default makes the first the tcq codec's default).",
    )
    p.add_argument(
        "--codec",
        choices=("cachegen", "tcq"),
        default="cachegen",
        help="the codec whose levels are calibrated (default: %(default)s)",
    )
    p.add_argument(
        "--model",
        default=models.EMBEDDED_DEFAULT,
        help="model name, hub id or directory (default: %(default)s)",
    )
    p.add_argument(
        "--target-ppl",
        type=_float_list,
        default=[1.0],
        help="perplexity change targets in percent, comma-separated; one level each (default: 1)",
    )
    p.add_argument(
        "--margin",
        type=float,
        default=0.8,
        help="aim at this fraction of the target on calibration windows (default: %(default)s)",
    )
    p.add_argument(
        "--windows", type=int, default=8, help="calibration windows (default: %(default)s)"
    )
    p.add_argument(
        "--context-tokens",
        type=int,
        default=1024,
        help="tokens of context per window (default: %(default)s)",
    )
    p.add_argument(
        "--continuation-tokens",
        type=int,
        default=64,
        help="scored tokens per window (default: %(default)s)",
    )
    p.add_argument(
        "--probe-groups",
        type=int,
        default=10,
        help="sensitivity probes per K/V: runs of consecutive layers (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="window sampling seed (default: %(default)s)"
    )
    p.add_argument(
        "--exact-tokens",
        type=int,
        default=1,
        help="store the first N tokens of a sequence exactly, the attention sink "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--no-derotate",
        action="store_true",
        help="quantize keys as the model stores them (after RoPE) instead of turned back by "
        "their rotary angles",
    )
    p.add_argument(
        "--level",
        type=int,
        default=4,
        help="level number for the first target; further targets take the next numbers "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--set-default",
        action="store_true",
        help="make the first target's level the model's default",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="report the choice without saving a level"
    )
    p.add_argument(
        "--select",
        choices=("kl", "ppl"),
        default="kl",
        help="how a target picks among verified allocations: kl = KL within the budget the "
        "target maps to (robust on few windows), ppl = measured perplexity change within margin "
        "x target (default: %(default)s)",
    )
    p.add_argument(
        "--apply",
        type=Path,
        metavar="CALIBRATION_JSON",
        help="do not measure: save the levels of an earlier run's calibration.json (same model; "
        "with --codec tcq: record the choices of its tcq-calibration.json)",
    )
    p.add_argument(
        "--trials",
        type=Path,
        metavar="CALIBRATION_JSON",
        help="do not measure allocations: choose again (--target-ppl, --select, --margin) among "
        "those an earlier run verified, on its windows",
    )
    p.add_argument(
        "--out", type=Path, help="also write calibration.json (all verified allocations) here"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_calibrate)


def _settings(args):
    from cachegen.lab.quality.datasets import DataSettings
    from cachegen.lab.quality.evaluate import EvalSettings

    for flag in ("windows", "context_tokens", "continuation_tokens", "gen_tokens"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1")
    data = DataSettings(
        dataset=args.dataset,
        windows=args.windows,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        retrieval_lengths=args.retrieval_lengths,
        seed=args.seed,
    )
    return data, EvalSettings(
        gen_tokens=args.gen_tokens, gen_windows=args.gen_windows, seed=args.seed
    )


def _command_line(name: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run (every data flag spelled out)."""
    parts = [
        f"cachegen {name}",
        f"--model {args.model}",
        f"--dataset {args.dataset}",
        f"--windows {args.windows}",
    ]
    from cachegen.lab.quality.datasets import TASKS

    if args.dataset in TASKS:
        if args.retrieval_lengths:
            parts.append(
                "--retrieval-lengths "
                + ",".join(f"{n}:{k}" if k else str(n) for n, k in args.retrieval_lengths)
            )
    else:
        parts += [
            f"--context-tokens {args.context_tokens}",
            f"--continuation-tokens {args.continuation_tokens}",
        ]
    parts += [f"--gen-tokens {args.gen_tokens}", f"--seed {args.seed}"]
    if args.gen_windows is not None:
        parts.append(f"--gen-windows {args.gen_windows}")
    for value in getattr(args, "codec", None) or []:
        parts.append(f"--codec {value}")
    if getattr(args, "levels", "all") != "all":
        parts.append(f"--levels {args.levels}")
    if getattr(args, "no_variants", False):
        parts.append("--no-variants")
    if getattr(args, "out", None):
        parts.append(f"--out {args.out}")
    return " ".join(parts)


def _eval(args: argparse.Namespace) -> int:
    from cachegen.extract import load_model
    from cachegen.lab.quality import frontier, report
    from cachegen.lab.quality.candidates import codec_candidates, parse_codec_args
    from cachegen.lab.quality.datasets import load_windows
    from cachegen.lab.quality.evaluate import evaluate

    data, settings = _settings(args)
    _, tokenizer, spec = load_model(args.model)
    candidates = [
        c
        for name, levels in parse_codec_args(args.codec, args.levels)
        for c in codec_candidates(spec, name, levels)
    ]
    windows = load_windows(data, tokenizer, spec.max_positions)
    labels = {"model": spec.name, "dataset": data.dataset}
    rows = evaluate(
        args.model, windows, candidates, settings, progress=not args.no_progress, labels=labels
    )
    frontier.annotate(rows)
    if args.out:
        document = report.new_document(
            {
                "command": _command_line("eval", args),
                "model": spec.name,
                "data": data.describe(),
                "windows": len(windows),
                "gen_tokens": settings.gen_tokens,
                "gen_windows": settings.gen_windows,
                "rows": rows,
            }
        )
        written = report.write_outputs(args.out, "eval", document, f"{spec.name} on {data.dataset}")
        print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(report.terminal_table(rows))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from cachegen.extract import load_model
    from cachegen.lab.quality import frontier, report
    from cachegen.lab.quality.datasets import load_windows
    from cachegen.lab.quality.evaluate import evaluate
    from cachegen.lab.quality.rd_sweep import check_targets, grid

    if (args.update or args.drop) and not args.replot:
        raise InputError("--update and --drop change an existing sweep: use them with --replot")
    if args.replot:
        document = report.read_document(args.out / "sweep.json")
        if args.update or args.drop:
            updates = [report.read_document(path) for path in args.update]
            report.update_rows(document, updates, args.drop)
            frontier.annotate(document["rows"])
            document["targets"] = check_targets(document["rows"])
        written = report.write_outputs(
            args.out,
            "sweep",
            document,
            f"{document['model']}: rate-distortion on {document['data']['dataset']}",
        )
        print(
            "wrote " + ", ".join(map(str, written if args.update or args.drop else written[1:])),
            file=sys.stderr,
        )
        return 0
    data, settings = _settings(args)
    _, tokenizer, spec = load_model(args.model)
    windows = load_windows(data, tokenizer, spec.max_positions)
    candidates = grid(spec, include_variants=not args.no_variants)
    labels = {"model": spec.name, "dataset": data.dataset}
    rows = evaluate(
        args.model, windows, candidates, settings, progress=not args.no_progress, labels=labels
    )
    frontier.annotate(rows)
    document = report.new_document(
        {
            "command": _command_line("sweep", args),
            "model": spec.name,
            "data": data.describe(),
            "windows": len(windows),
            "gen_tokens": settings.gen_tokens,
            "gen_windows": settings.gen_windows,
            "targets": check_targets(rows),
            "rows": rows,
        }
    )
    written = report.write_outputs(
        args.out, "sweep", document, f"{spec.name}: rate-distortion on {data.dataset}"
    )
    print("wrote " + ", ".join(map(str, written)), file=sys.stderr)
    print(json.dumps(rows, indent=2) if args.json else report.terminal_table(rows))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from cachegen.lab.quality import report
    from cachegen.lab.quality.calibrate import CalibrationSettings, calibrate, save_level

    if args.codec == "tcq":
        return _calibrate_tcq(args)
    if args.apply and args.trials:
        raise InputError("--apply and --trials are alternatives: give one")
    if args.apply:
        from cachegen.lab.quality.calibrate import load_choices

        saved = [
            save_level(args.model, config, args.level + i, make_default=args.set_default and i == 0)
            for i, config in enumerate(load_choices(args.apply, args.model))
        ]
        if args.json:
            print(json.dumps(saved, indent=2))
        for entry in [] if args.json else saved:
            print(
                f"saved level {entry['level']} of {entry['profile']}"
                + (" (the default)" if entry["default"] else "")
            )
        return 0
    for flag in ("windows", "context_tokens", "continuation_tokens", "probe_groups"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0 <= args.exact_tokens <= 65535:
        raise InputError(f"--exact-tokens must be in 0..65535, got {args.exact_tokens}")
    settings = CalibrationSettings(
        targets=tuple(args.target_ppl),
        margin=args.margin,
        select=args.select,
        windows=args.windows,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        probe_groups=args.probe_groups,
        seed=args.seed,
        derotate_keys=not args.no_derotate,
        exact_tokens=args.exact_tokens,
    )
    if args.trials:
        from cachegen.lab.quality.calibrate import choose_again

        result = choose_again(args.model, args.trials, settings, progress=not args.no_progress)
    else:
        result = calibrate(args.model, settings, progress=not args.no_progress)
    summary = result.to_dict()
    if not args.dry_run:
        for i, (choice, entry) in enumerate(zip(result.choices, summary["choices"])):
            entry["saved"] = save_level(
                args.model, choice.config, args.level + i, make_default=args.set_default and i == 0
            )
    if args.out:
        report.write_json(args.out / "calibration.json", summary)
    if args.json:
        print(json.dumps({k: v for k, v in summary.items() if k != "trials"}, indent=2))
        return 0
    print(
        f"{len(result.trials)} allocations verified on {result.settings.windows} calibration "
        f"windows (aiming at {result.settings.margin:.0%} of each target)"
    )
    for entry in summary["choices"]:
        config = entry["config"]
        print(
            f"target |perplexity change| <= {entry['target_ppl_pct']:g}%: "
            f"hadamard={config['hadamard']} key_scale={config['key_scale']} "
            f"value_scale={config['value_scale']}"
        )
        print(f"  key bins   {config['key_bins']}")
        print(f"  value bins {config['value_bins']}")
        print(
            f"  {entry['codec_bits_per_element']:.3f} bits/element through the codec; "
            "on the calibration windows "
            f"perplexity {entry['ppl_change_pct']:+.2f}%, KL {entry['kl']:.4f}, "
            f"top-1 agreement {100 * entry['top1_agreement']:.1f}%"
        )
        if "saved" in entry:
            saved = entry["saved"]
            print(
                f"  saved as level {saved['level']} of {saved['profile']}"
                + (" (the default)" if saved["default"] else "")
            )
    return 0


def _calibrate_tcq(args: argparse.Namespace) -> int:
    from cachegen.lab.quality import report
    from cachegen.lab.quality.calibrate import CalibrationSettings
    from cachegen.lab.quality.tcq_calibrate import (
        calibrate_tcq,
        read_calibration,
        save_choices,
        unmet,
    )

    cachegen_only = {
        "--trials": args.trials,
        "--no-derotate": args.no_derotate,
        "--level": args.level != 4,
        "--exact-tokens": args.exact_tokens != 1,
        "--probe-groups": args.probe_groups != 10,
    }
    given = [flag for flag, value in cachegen_only.items() if value]
    if given:
        raise InputError(
            f"{', '.join(given)} calibrate cachegen levels; a tcq level's bits are fixed by its "
            "model file (drop them, or use --codec cachegen)"
        )
    if args.apply:
        saved = save_choices(
            args.model, read_calibration(args.apply), make_default=args.set_default
        )
        print(json.dumps(saved, indent=2) if args.json else f"recorded {saved}")
        return 0
    for flag in ("windows", "context_tokens", "continuation_tokens"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1")
    settings = CalibrationSettings(
        targets=tuple(args.target_ppl),
        margin=args.margin,
        select=args.select,
        windows=args.windows,
        context_tokens=args.context_tokens,
        continuation_tokens=args.continuation_tokens,
        seed=args.seed,
    )
    document = calibrate_tcq(args.model, settings, progress=not args.no_progress)
    missed = unmet(document)
    status = 1 if len(missed) == len(document["choices"]) else 0
    if not args.dry_run and not status:  # nothing met: the earlier record stays as it was
        document["saved"] = save_choices(args.model, document, make_default=args.set_default)
    if args.out:
        report.write_json(args.out / "tcq-calibration.json", document)
    for choice in missed:
        print(f"warning: {choice['unmet']}", file=sys.stderr)
    if args.json:
        print(json.dumps(document, indent=2))
        return status
    print(
        f"tcq model {document['tcq_model']}: {len(document['trials'])} levels on "
        f"{document['windows']} calibration windows"
    )
    for t in document["trials"]:
        print(
            f"  level {t['level']}: {t['bits_per_element']:.3f} bits/element, perplexity "
            f"{t['ppl_change_pct']:+.2f}%, KL {t['kl']:.4f}, top-1 {100 * t['top1_agreement']:.1f}%"
        )
    for choice in document["choices"]:
        target = choice["target_ppl_pct"]
        print(f"target |perplexity change| <= {target:g}%: level {choice['level'] or 'none'}")
    if "saved" in document:
        default = document["saved"]["default_level"]
        print("recorded" + (f"; level {default} is the tcq default" if default else ""))
    return status
