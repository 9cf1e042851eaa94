"""``cachegen ttft table|timeline|placement``: TTFT and loads through vLLM with the connector
(docs/connector.md)."""

from __future__ import annotations

import argparse

from cachegen.cli import options
from cachegen.errors import InputError
from cachegen.modes import CACHEGEN, TCQ
from cachegen_lab.bench.links import UNLIMITED
from cachegen_lab.cli import experiment, tables
from cachegen_lab.peers import PEER_MODES

# --json documents: schema name and the row kind of rows.schema.json (placement rows are not
# measurement rows of one request)
DOCUMENTS = {
    "table": ("cachegen-ttft-table", "ttft"),
    "timeline": ("cachegen-ttft-timeline", "timeline"),
    "placement": ("cachegen-ttft-placement", None),
}


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "ttft",
        None,
        help="time to first token through vLLM with the connector, per mode, level and bandwidth",
        description="Measure TTFT through one in-process vLLM engine with the CacheGenConnector "
        "(the tables and timeline in docs/connector.md).",
    )
    actions = options.actions(p)
    t = _action(actions, "table", _table, "TTFT per mode, level and bandwidth")
    _table_arguments(t)
    tl = _action(
        actions, "timeline", _timeline, "split TTFT into the load and what follows it, per mode"
    )
    tl.add_argument("--context", type=int, default=4096)
    tl.add_argument("--bandwidth", type=float, default=1000.0)
    tl.add_argument(
        "--modes",
        nargs="+",
        default=["recompute", "int8", "cachegen-1", "cachegen-2", "cachegen"],
        help="recompute, raw, int8, fp8, cachegen-LEVEL, cachegen (the default level), adaptive",
    )
    tl.add_argument("--repeats", type=int, default=3)
    pl = _action(actions, "placement", _placement, "inline vs background loads and saves")
    for q in (t, tl, pl):
        tables.add_outputs(q)
    for name in experiment.MOVED_FROM_TTFT:
        experiment.add_moved(actions, name)


def _action(actions, name: str, handler, help: str) -> argparse.ArgumentParser:
    p = options.command(actions, name, handler, help)
    options.model(p, help=None)
    return p


def _table_arguments(t: argparse.ArgumentParser) -> None:
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
        "the transform codec's --tcq-levels; lmcache-cachegen, LMCache's CacheGen, the lab's "
        "peer codec)",
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
        type=options.level_or_form(CACHEGEN),
        nargs="+",
        default=None,
        help="the cachegen levels stored and measured, and forms such as cachegen-11-packed "
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


def _table(args: argparse.Namespace) -> int:
    from cachegen.profiles import codec_for
    from cachegen_lab.bench.ttft import SAVE_MODES, TTFTBench, markdown, ttft_table

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
    peers = [m for m in args.modes or () if m in PEER_MODES]
    if peers:  # a peer codec is stored only when measured (LMCache's encoder is slow)
        engine_args["save_modes"] = (*engine_args.get("save_modes", SAVE_MODES), *peers)
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
    from cachegen_lab.bench.ttft import TTFTBench, parse_mode, timeline, timeline_markdown

    modes = [parse_mode(m) for m in args.modes]
    with TTFTBench(args.model) as bench:
        rows = timeline(bench, args.context, modes, args.bandwidth, repeats=args.repeats)
    return _emit(args, rows, timeline_markdown(rows))


def _placement(args: argparse.Namespace) -> int:
    from cachegen_lab.bench.ttft import placement, placement_markdown

    rows = placement(args.model)
    return _emit(args, rows, placement_markdown(rows))


def _emit(args: argparse.Namespace, rows: list[dict], text: str) -> int:
    return tables.emit(args, rows, text, *DOCUMENTS[args.action])
