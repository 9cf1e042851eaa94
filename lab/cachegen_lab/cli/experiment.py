"""``cachegen experiment NAME``: the lab's one-question experiments (``cachegen_lab.experiments``),
kept out of the everyday commands' list; ``cachegen experiment --help`` lists them."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from cachegen.cli import options
from cachegen.errors import InputError
from cachegen.models import EMBEDDED_DEFAULT
from cachegen_lab.cli import tables

MOVED_FROM_TTFT = ("window", "repeat")  # spelled `cachegen ttft NAME` before


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "experiment",
        None,
        help="the lab's one-question experiments (tcq ablation, packed fit, window, ...)",
        description="Run one of the lab's one-question experiments, each behind a finding of "
        "docs/ (lab/cachegen_lab/experiments).",
    )
    names = options.actions(p, dest="experiment", metavar="NAME")
    _register_tcq(names)
    _register_packed_fit(names)
    for name, (help, description, add_arguments, handler) in THROUGH_VLLM.items():
        add_arguments(options.command(names, name, handler, help, description))


def add_moved(actions, name: str) -> None:
    """``cachegen ttft NAME``, experiment ``name``'s old spelling: unlisted, it still runs, after
    a note of the new one."""
    _, description, add_arguments, handler = THROUGH_VLLM[name]

    def run(args: argparse.Namespace) -> int:
        print(f"note: `cachegen ttft {name}` is now `cachegen experiment {name}`", file=sys.stderr)
        return handler(args)

    add_arguments(options.command(actions, name, run, help=None, description=description))


def _register_tcq(names) -> None:
    p = options.command(
        names,
        "tcq-ablation",
        _tcq_ablation,
        help="where tcq's gains come from: its PCA transform or its component weights",
        description="Ablate tcq's PCA transform and its component weights at equal "
        "calibration bits per element; perplexity change and per-layer bits of each variant.",
    )
    _tcq_data(p, "comma-separated evaluation datasets", windows=8, windows_help=None)
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--continuation-tokens", type=int, default=128)
    p.add_argument("--levels", default="21,23,25", help="comma-separated tcq levels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--split",
        default="eval",
        choices=("eval", "calibrate"),
        help="pydoc's split: eval (held out) or calibrate (to choose a variant on)",
    )
    _tcq_outputs(p)
    p = options.command(
        names,
        "tcq-redundancy",
        _tcq_redundancy,
        help="what redundancy tcq leaves in its symbols, and where a next coder could find it",
        description="Entropy of a tcq level's symbols on held-out text, each on its own, "
        "given the previous token, given its token's loudness, and after a linear prediction "
        "from the previous layer.",
    )
    _tcq_data(p, "comma-separated evaluation domains", 16, "measured windows per domain")
    p.add_argument("--level", type=int, default=22)
    p.add_argument("--fit-windows", type=int, default=16, help="calibrate-split windows")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--sources", default="64,all", help="predictor inputs per kind, or 'all'")
    p.add_argument("--seed", type=int, default=0)
    _tcq_outputs(p)
    p = options.command(
        names,
        "tcq-layers",
        _tcq_layers,
        help="what one layered tcq stream per chunk would cost, its prefixes coarser levels",
        description="Bits and distortion of tcq's dedicated levels beside two layered streams "
        "built from them: prefixes that decode to dedicated levels exactly, and a top level's "
        "symbols embedded under a coarser base (--base).",
    )
    _tcq_data(p, "comma-separated domains", 4, "windows per domain")
    p.add_argument("--top-level", type=int, default=24, help="the layered stream's finest level")
    p.add_argument(
        "--base",
        default="dead-zone",
        choices=("dead-zone", "triple-step"),
        help="the embedded stream's base: the top level's cells merged in pairs beside a zero "
        "cell of three (dead-zone), or in threes, a uniform grid of three times its step "
        "(triple-step)",
    )
    p.add_argument(
        "--perplexity-calibration-windows",
        type=int,
        default=0,
        help="also score the prefixes' perplexity, their slopes chosen on this many windows "
        "of pydoc's calibrate split (0: bits and distortion only)",
    )
    p.add_argument(
        "--ladder", default="20,22,24", help="the exact stream's levels, rising to --top-level"
    )
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--continuation-tokens", type=int, default=128, help="scored tokens per window")
    p.add_argument(
        "--split",
        default="eval",
        choices=("eval", "calibrate"),
        help="pydoc's split: eval (held out) or calibrate (to choose a layout on)",
    )
    p.add_argument("--seed", type=int, default=0)
    _tcq_outputs(p)
    p = options.command(
        names,
        "tcq-prediction",
        _tcq_prediction,
        help="what tcq's cross-layer prediction saves, at the same decoded KV",
        description="Bits per element of tcq levels on held-out windows with the codec's model "
        "file (the shipped one of an embedded model) as it is and with a cross-layer predictor "
        "fitted onto it, and whether both decode to the same KV.",
    )
    _tcq_data(p, "comma-separated evaluation domains", 16, "windows per domain")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument(
        "--continuation-tokens", type=int, default=128, help="(chooses the windows as eval does)"
    )
    p.add_argument("--levels", default="22,23,24,25", help="comma-separated tcq levels")
    p.add_argument("--seed", type=int, default=0)
    _tcq_outputs(p)


def _tcq_data(p, datasets: str, windows: int, windows_help: str | None) -> None:
    options.model(p, help=None, default=None)
    p.add_argument("--dataset", default="prose", help=datasets)
    p.add_argument("--windows", type=int, default=windows, help=windows_help)


def _tcq_outputs(p) -> None:
    options.json_file(p)
    options.no_progress(p, help=None)


def _finish(args: argparse.Namespace, compute: Callable[[str], dict], table) -> int:
    """Run ``compute`` with the command line that reproduces it; write and show its document
    (exit status 2 with the reason when the arguments are wrong)."""
    from cachegen_lab.quality import report

    words = ["cachegen", "experiment", args.experiment]
    command = options.command_line(words, args, {"func", "command", "experiment"})
    return report.finish_run(lambda: compute(command), args.json, table)


def _datasets(args: argparse.Namespace) -> list[str]:
    return [x.strip() for x in args.dataset.split(",") if x.strip()]


def _level_ids(text: str, flag: str = "--levels") -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InputError(f"{flag} must be comma-separated integers, got {text!r}") from exc


def _sources(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in (x.strip() for x in text.split(",")):
        if part == "all":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise InputError(f"--sources takes positive counts or 'all', got {part!r}")
    return out


def _tcq_ablation(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments import tcq_ablation

    def compute(command: str) -> dict:
        return tcq_ablation.run_ablation(
            args.model,
            _datasets(args),
            _level_ids(args.levels),
            args.windows,
            args.context_tokens,
            args.continuation_tokens,
            args.seed,
            command,
            progress=not args.no_progress,
            split=args.split,
        )

    return _finish(args, compute, tcq_ablation.table)


def _tcq_redundancy(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments import tcq_redundancy

    def compute(command: str) -> dict:
        return tcq_redundancy.run(
            args.model,
            args.level,
            _datasets(args),
            args.windows,
            args.fit_windows,
            args.context_tokens,
            _sources(args.sources),
            args.seed,
            command,
            progress=not args.no_progress,
        )

    return _finish(args, compute, tcq_redundancy.table)


def _tcq_layers(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments import tcq_layers

    def compute(command: str) -> dict:
        return tcq_layers.run(
            args.model,
            args.top_level,
            _level_ids(args.ladder, "--ladder"),
            _datasets(args),
            args.windows,
            (args.context_tokens, args.continuation_tokens),
            args.split,
            args.seed,
            command,
            progress=not args.no_progress,
            quality_windows=args.perplexity_calibration_windows,
            base=args.base,
        )

    return _finish(args, compute, tcq_layers.table)


def _tcq_prediction(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments import tcq_prediction

    def compute(command: str) -> dict:
        return tcq_prediction.run(
            args.model,
            _datasets(args),
            args.windows,
            args.context_tokens,
            args.continuation_tokens,
            _level_ids(args.levels),
            args.seed,
            command,
            progress=not args.no_progress,
        )

    return _finish(args, compute, tcq_prediction.table)


def _register_packed_fit(names) -> None:
    from cachegen_lab.experiments.packed_fit import BUDGET_BITS

    p = options.command(
        names,
        "packed-fit",
        None,
        help="which calibrated allocations fit a store that holds a level coded and packed",
        description="Rank a calibration's verified trials by coded + packed fit, or verify "
        "hand-written allocations on an earlier calibration's windows.",
    )
    actions = options.actions(p)
    r = options.command(
        actions, "rank", _packed_rank, "rank a calibration's trials by coded + packed fit"
    )
    r.add_argument("calibration", type=Path)
    r.add_argument("--budget", type=float, default=BUDGET_BITS)
    r.add_argument("--by", choices=("ppl", "kl"), default="ppl")
    r.add_argument("--top", type=int, default=10)
    r.add_argument("--out", type=Path)
    v = options.command(
        actions, "verify", _packed_verify, "verify candidate allocations on calibration windows"
    )
    options.model(v, help=None, default=None)
    v.add_argument("--candidates", type=Path, required=True)
    v.add_argument("--like", type=Path, required=True, help="the calibration whose windows to use")
    v.add_argument("--out", type=Path, required=True)


def _write(path: Path, document: dict) -> None:
    from cachegen.fileio import write_atomic

    write_atomic(path, (json.dumps(document, indent=1) + "\n").encode())


def _packed_verify(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments import packed_fit

    earlier = packed_fit.read_document(args.like)
    candidates = packed_fit.read_document(args.candidates, packed_fit.CANDIDATES_SCHEMA)
    _write(args.out, packed_fit.verify(args.model, candidates["candidates"], earlier))
    return 0


def _packed_rank(args: argparse.Namespace) -> int:
    from cachegen.fileio import versioned
    from cachegen_lab.experiments import packed_fit

    rows = packed_fit.rank(packed_fit.read_document(args.calibration), args.budget, args.by)
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
        _write(args.out, versioned(packed_fit.SCHEMA, packed_fit.VERSION, body))
    return 0


def _window_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma3-270m")
    p.add_argument(
        "--context", type=int, default=4096, help="stored prefix in tokens (whole chunks load)"
    )
    p.add_argument("--modes", nargs="+", default=["raw", "cachegen"], choices=["raw", "cachegen"])
    tables.add_outputs(p)


def _window(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments.window import window_bench, window_markdown, window_rows

    with window_bench(args.model, args.context) as bench:
        rows = window_rows(bench, args.context, args.modes)
    return tables.emit(args, rows, window_markdown(rows), "cachegen-ttft-window", None)


def _repeat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EMBEDDED_DEFAULT)
    p.add_argument("--context", type=int, default=3072, help="document tokens")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens of each answer")
    p.add_argument("--repeats", type=int, default=3)
    tables.add_outputs(p)


def _repeat(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments.repeat import repeat_bench, repeat_markdown, repeat_rows

    with repeat_bench(args.model, args.context) as bench:
        rows = repeat_rows(
            bench, args.context, output_tokens=args.output_tokens, repeats=args.repeats
        )
    return tables.emit(args, rows, repeat_markdown(rows), "cachegen-ttft-repeat", None)


def _lmcache_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=EMBEDDED_DEFAULT)
    p.add_argument("--numbers", type=int, default=700, help="numbers the prompt counts")
    tables.add_outputs(p)


def _lmcache(args: argparse.Namespace) -> int:
    from cachegen_lab.experiments import lmcache_connector

    body = lmcache_connector.run(args.model, args.numbers)
    text = lmcache_connector.markdown(body)
    return tables.emit(args, [body], text, "cachegen-lmcache-connector", None)


# experiments that measure through one vLLM engine: help, description, arguments, handler
THROUGH_VLLM = {
    "window": (
        "bytes a load fetches with skip_out_of_window on and off, answers vs recompute",
        "Store a context once, recompute the prompt, then load the stored prefix with the "
        "connector's skip_out_of_window on and off (a model with sliding-window layers).",
        _window_arguments,
        _window,
    ),
    "repeat": (
        "delay from a prefill's end to its chunks being loadable; an immediate repeat's TTFT",
        "With the connector's default storage, measure how long after a prefill every whole "
        "chunk of its prompt is loadable (and every level stored), and the TTFT of a second "
        "question sent the moment the first answer ends.",
        _repeat_arguments,
        _repeat,
    ),
    "lmcache-connector": (
        "what LMCache's own vLLM connector loads on this machine (none on vLLM's CPU build)",
        "Answer one counting prompt twice through an engine with LMCacheConnectorV1 (its local "
        "CPU backend, prefix caching off): the tokens it loaded for the repeat, and LMCache's "
        "errors.",
        _lmcache_arguments,
        _lmcache,
    ),
}
