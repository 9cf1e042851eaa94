"""``cachegen ttft table|timeline|placement|window|repeat``: TTFT and loads through vLLM with the
connector (docs/connector.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachegen.errors import InputError
from cachegen.fileio import versioned, write_atomic
from cachegen.lab.bench.links import UNLIMITED
from cachegen.models import EMBEDDED_DEFAULT
from cachegen.modes import TCQ

# --json documents: schema name and the row kind of rows.schema.json (placement rows are not
# measurement rows of one request)
DOCUMENTS = {
    "table": ("cachegen-ttft-table", "ttft"),
    "timeline": ("cachegen-ttft-timeline", "timeline"),
    "placement": ("cachegen-ttft-placement", None),
    "window": ("cachegen-ttft-window", None),
    "repeat": ("cachegen-ttft-repeat", None),
}
VERSION = 1


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ttft",
        help="time to first token through vLLM with the connector, per mode, level and bandwidth",
        description="Measure TTFT through one in-process vLLM engine with the CacheGenConnector "
        "(the tables and timeline in docs/connector.md).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    t = actions.add_parser("table", help="TTFT per mode, level and bandwidth")
    t.add_argument("--model", default=EMBEDDED_DEFAULT)
    t.add_argument("--contexts", type=int, nargs="+", default=[1536, 4096])
    t.add_argument(
        "--bandwidths",
        type=lambda text: None if text == UNLIMITED else float(text),
        nargs="+",
        default=[100, 500, 1000, 5000, 20000, None],
        help=f"link rates in Mbit/s, or {UNLIMITED} (default: 100 500 1000 5000 20000 {UNLIMITED})",
    )
    t.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="modes to measure (default: recompute raw int8 fp8 cachegen adaptive; tcq measures "
        "the transform codec's --tcq-levels)",
    )
    t.add_argument(
        "--slo-ms", type=float, default=None, help="adaptive's load budget (default: 1000)"
    )
    t.add_argument(
        "--max-loss-pct",
        type=float,
        default=None,
        help="adaptive loads the fastest stored form within this quality loss (perplexity "
        "change, %%) instead of keeping to --slo-ms (the connector's max_loss_pct)",
    )
    t.add_argument(
        "--cachegen-levels",
        type=int,
        nargs="+",
        default=None,
        help="the cachegen levels stored and measured; a level's packed form is level | 32768 "
        "(default: every level of the model's profile)",
    )
    t.add_argument(
        "--tcq-levels",
        type=int,
        nargs="+",
        default=None,
        help="with the mode tcq: the tcq levels stored and measured (default: every level of "
        "the model's tcq model)",
    )
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument(
        "--shaper",
        choices=["token-bucket", "netns"],
        default="token-bucket",
        help="how the link rate is enforced (netns: kernel tc in a private network namespace, "
        "root)",
    )
    t.set_defaults(func=_table)
    tl = actions.add_parser(
        "timeline", help="split TTFT into the load and what follows it, per mode"
    )
    tl.add_argument("--model", default=EMBEDDED_DEFAULT)
    tl.add_argument("--context", type=int, default=4096)
    tl.add_argument("--bandwidth", type=float, default=1000.0)
    tl.add_argument(
        "--modes",
        nargs="+",
        default=["recompute", "int8", "cachegen-1", "cachegen-2", "cachegen"],
        help="recompute, raw, int8, fp8, cachegen-LEVEL, cachegen (the default level), adaptive",
    )
    tl.add_argument("--repeats", type=int, default=3)
    tl.set_defaults(func=_timeline)
    pl = actions.add_parser("placement", help="inline vs background loads and saves")
    pl.add_argument("--model", default=EMBEDDED_DEFAULT)
    pl.set_defaults(func=_placement)
    w = actions.add_parser(
        "window",
        help="bytes a load fetches with skip_out_of_window on and off, answers vs recompute",
        description="Store a context once, recompute the prompt, then load the stored prefix "
        "with the connector's skip_out_of_window on and off (a model with sliding-window "
        "layers).",
    )
    w.add_argument("--model", default="gemma3-270m")
    w.add_argument(
        "--context", type=int, default=4096, help="stored prefix in tokens (whole chunks load)"
    )
    w.add_argument("--modes", nargs="+", default=["raw", "cachegen"], choices=["raw", "cachegen"])
    w.set_defaults(func=_window)
    r = actions.add_parser(
        "repeat",
        help="delay from a prefill's end to its chunks being loadable; an immediate repeat's TTFT",
        description="With the connector's default storage, measure how long after a prefill "
        "every whole chunk of its prompt is loadable (and every level stored), and the TTFT "
        "of a second question sent the moment the first answer ends.",
    )
    r.add_argument("--model", default=EMBEDDED_DEFAULT)
    r.add_argument("--context", type=int, default=3072, help="document tokens")
    r.add_argument("--output-tokens", type=int, default=32, help="tokens of each answer")
    r.add_argument("--repeats", type=int, default=3)
    r.set_defaults(func=_repeat)
    for q in (t, tl, pl, w, r):
        q.add_argument(
            "--json", type=Path, help="also write every row to this JSON file (schema and version)"
        )
        q.add_argument(
            "--markdown", type=Path, help="also write the tables to this file (vLLM logs to stdout)"
        )


def _table(args: argparse.Namespace) -> int:
    from cachegen.lab.bench.ttft import SAVE_MODES, TTFTBench, markdown, ttft_table
    from cachegen.profiles import codec_for

    engine_args: dict = {}
    extra: dict = {}
    if args.cachegen_levels is not None:
        engine_args["cachegen_levels"] = args.cachegen_levels
    if args.max_loss_pct is not None:  # the engine's default: every adaptive request's bound
        extra["max_loss_pct"] = args.max_loss_pct
    if args.modes and TCQ in args.modes:
        engine_args["save_modes"] = (*SAVE_MODES, TCQ)
        extra["tcq_levels"] = args.tcq_levels or codec_for(TCQ, args.model).levels
    elif args.tcq_levels is not None:
        raise InputError("--tcq-levels goes with the mode tcq (--modes ... tcq)")
    if extra:
        engine_args["connector_extra"] = extra
    with TTFTBench(args.model, shaper=args.shaper, **engine_args) as bench:
        rows = ttft_table(
            bench,
            args.contexts,
            args.bandwidths,
            args.modes,
            slo_ms=args.slo_ms,
            repeats=args.repeats,
        )
    return _emit(args, rows, markdown(rows, max_loss_pct=args.max_loss_pct))


def _timeline(args: argparse.Namespace) -> int:
    from cachegen.lab.bench.ttft import TTFTBench, parse_mode, timeline, timeline_markdown

    modes = [parse_mode(m) for m in args.modes]
    with TTFTBench(args.model) as bench:
        rows = timeline(bench, args.context, modes, args.bandwidth, repeats=args.repeats)
    return _emit(args, rows, timeline_markdown(rows))


def _placement(args: argparse.Namespace) -> int:
    from cachegen.lab.bench.ttft import placement, placement_markdown

    rows = placement(args.model)
    return _emit(args, rows, placement_markdown(rows))


def _window(args: argparse.Namespace) -> int:
    from cachegen.lab.bench.window import window_bench, window_markdown, window_rows

    with window_bench(args.model, args.context) as bench:
        rows = window_rows(bench, args.context, args.modes)
    return _emit(args, rows, window_markdown(rows))


def _repeat(args: argparse.Namespace) -> int:
    from cachegen.lab.bench.repeat import repeat_bench, repeat_markdown, repeat_rows

    with repeat_bench(args.model, args.context) as bench:
        rows = repeat_rows(
            bench, args.context, output_tokens=args.output_tokens, repeats=args.repeats
        )
    return _emit(args, rows, repeat_markdown(rows))


def _emit(args: argparse.Namespace, rows: list[dict], text: str) -> int:
    print(text)
    if args.markdown:
        write_atomic(args.markdown, (text + "\n").encode())
    if args.json:
        from cachegen.lab import rows as row_schema

        name, kind = DOCUMENTS[args.action]
        if kind is not None:
            row_schema.validate(rows, kind, str(args.json))
        document = versioned(name, VERSION, {"rows": rows})
        write_atomic(args.json, (json.dumps(document, indent=1) + "\n").encode())
    return 0
