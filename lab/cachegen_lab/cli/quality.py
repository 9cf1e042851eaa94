"""Quality subcommands: ``cachegen eval``, ``cachegen eval-table`` and ``cachegen sweep``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cachegen.cli import options
from cachegen.cli.options import DEFAULT
from cachegen.errors import InputError

ROWS_JSON = "print the result rows as JSON"
SIZES = ("windows", "context_tokens", "continuation_tokens", "seed")  # of the windows


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


def _data_args(p: argparse.ArgumentParser, windows: int) -> None:
    options.model(p)
    p.add_argument(
        "--dataset",
        default="pydoc",
        help="'pydoc' (CPython's documentation text), 'prose' (Sherlock Holmes stories), "
        "'code' (Python standard library source), 'dialogue' (Shakespeare's plays), 'legal' "
        "(software licences), 'science' (Newton's Opticks), all held out from calibration "
        "text; 'retrieval' (LongChat-style lines), 'passkey' (a 5-digit key hidden in filler "
        "text) or a path to a UTF-8 text or JSONL file" + DEFAULT,
    )
    samples = "evaluation windows; for 'retrieval' and 'passkey' samples per context length"
    options.integer(p, "--windows", windows, samples)
    options.integer(p, "--context-tokens", 1024, "tokens of context whose KV is compressed")
    options.integer(p, "--continuation-tokens", 128, "scored tokens after the context")
    p.add_argument(
        "--retrieval-lengths",
        type=_length_list,
        default=None,
        help="context lengths in tokens of the 'retrieval' and 'passkey' tasks, each optionally "
        "with its own sample count, "
        "e.g. 1024:40,2048:20,8064 (default: 1K doubling up to the model's limit, --windows "
        "samples each)",
    )
    greedy = "greedy tokens per window for exact match/ROUGE-L/BLEU"
    options.integer(p, "--gen-tokens", 64, greedy)
    first = "run greedy generation on the first N windows only (default: all)"
    p.add_argument("--gen-windows", type=int, default=None, help=first)
    options.seed(p, "seed for window sampling and bootstrap")
    options.no_progress(p)


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "eval",
        _eval,
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
    options.json_flag(p, ROWS_JSON)
    p.add_argument(
        "--out",
        type=Path,
        help="also write eval.json, eval.md and eval.png (rate-distortion plot) here",
    )
    _register_sweep(subparsers)
    _register_table(subparsers)


def _register_table(subparsers) -> None:
    p = options.command(
        subparsers,
        "eval-table",
        _table,
        help="codecs side by side across models and datasets, from `cachegen eval --out` results",
        description="One Markdown row per model and dataset, one cell per codec (bits/element, "
        "perplexity change with its 95%% interval, top-1 agreement), and for each model how the "
        "--versus codec's bits compare with each other codec's.",
    )
    p.add_argument("evals", nargs="+", type=Path, metavar="EVAL_JSON", help="eval.json files")
    p.add_argument(
        "--versus",
        default="lmcache-cachegen",
        metavar="CODEC",
        help="the codec every other is compared with" + DEFAULT,
    )
    options.json_flag(p, "print the table's cells and comparisons as a JSON document")


def _register_sweep(subparsers) -> None:
    p = options.command(
        subparsers,
        "sweep",
        _sweep,
        help="rate-distortion sweep over codecs, levels and codec options (JSON + PNG + Markdown)",
        description="Evaluate every baseline codec, every level of the model's cachegen profile "
        "and a grid of cachegen options on the same windows; write sweep.json, sweep.md and "
        "sweep.png (with the Pareto frontier of bits/element against each metric) into --out.",
    )
    _data_args(p, windows=256)
    p.set_defaults(gen_windows=32)
    options.switch(p, "--no-variants", "only the codecs' own levels, no extra cachegen options")
    p.add_argument(
        "--out", type=Path, required=True, help="directory for sweep.json, sweep.md and sweep.png"
    )
    replot = "do not measure: rewrite sweep.md and sweep.png from --out's sweep.json"
    options.switch(p, "--replot", replot)
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
    options.json_flag(p, ROWS_JSON)


def _table(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from cachegen.fileio import versioned
    from cachegen_lab.quality import side_by_side
    from cachegen_lab.quality.report import read_document

    table = side_by_side.cells([read_document(path) for path in args.evals])
    comparisons = side_by_side.versus(table, args.versus)
    if args.json:
        cells = [
            {"model": model, "dataset": dataset, "codec": label, **asdict(cell)}
            for (model, dataset), row in table.items()
            for label, cell in row.items()
        ]
        body = {
            "cells": cells,
            "versus": args.versus,
            "comparisons": [asdict(c) for c in comparisons],
        }
        print(json.dumps(versioned(side_by_side.SCHEMA, side_by_side.VERSION, body), indent=2))
        return 0
    print(side_by_side.markdown(table))
    print(side_by_side.versus_markdown(comparisons, args.versus), end="")
    return 0


def _settings(args):
    from cachegen_lab.quality.datasets import DataSettings
    from cachegen_lab.quality.evaluate import EvalSettings

    options.require_positive(args, *SIZES[:-1], "gen_tokens")
    data = DataSettings(
        dataset=args.dataset,
        retrieval_lengths=args.retrieval_lengths,
        **options.values(args, *SIZES),
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
    from cachegen_lab.quality.datasets import TASKS

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
    from cachegen_lab.quality import frontier, report
    from cachegen_lab.quality.candidates import codec_candidates, parse_codec_args
    from cachegen_lab.quality.datasets import load_windows
    from cachegen_lab.quality.evaluate import evaluate

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
    from cachegen_lab.quality import frontier, report
    from cachegen_lab.quality.datasets import load_windows
    from cachegen_lab.quality.evaluate import evaluate
    from cachegen_lab.quality.rd_sweep import check_targets, grid

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
