"""``cachegen stream-bench``: load real encoded KV through a shaped link and measure it."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from cachegen import models
from cachegen.cli import options
from cachegen.errors import InputError
from cachegen.store import open_store
from cachegen.stream.controller import DEFAULT_DROP_FACTOR, DEFAULT_SWITCH_MARGIN
from cachegen_lab import rows
from cachegen_lab.bench import stream_bench as bench
from cachegen_lab.bench import stream_forms as forms
from cachegen_lab.network.link import SHAPERS


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "stream-bench",
        _stream_bench,
        help="stream encoded KV chunks through a bandwidth-limited link and measure goodput "
        "and load time",
        description="Encode TOKENS tokens of real text (model KV via transformers, codec NAME) "
        "into the store once, then load them through a rate-limited TCP link on 127.0.0.1 with "
        "pipelined decoding and print goodput_mbps, bytes, transfer_s, decode_s, load_s and "
        "levels (docs/benchmarks.md, Vocabulary). With --controller-eval, evaluate the adaptive "
        "controller over bandwidth traces instead; with --forms, compare stored forms loaded "
        "alone with the per-chunk choice of the fastest form within a quality bound "
        "(docs/streaming.md).",
    )
    options.store(p, "chunk store URL")
    options.model(p, "model name")
    options.codec(p)
    options.integer(p, "--tokens", 4096, "context length in tokens")
    options.chunk_tokens(p)
    _link_arguments(p)
    _load_arguments(p)
    _forms_arguments(p)
    prefill = "recompute cost in prefill tokens/s (default: measured with transformers)"
    p.add_argument("--prefill-tps", type=float, default=None, help=prefill)
    repeat = "runs per shaper and bandwidth (default: 1)"
    p.add_argument("--repeat", type=int, default=1, help=repeat)
    _eval_arguments(p)
    options.json_flag(p, "print the full results as JSON on stdout")


def _link_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bandwidth-mbps",
        default=None,
        help="link rate in Mbit/s, a comma list (100,500,1000), or a trace: constant:R, "
        "step:R1:R2:AT_S, walk:MEAN:SEED (token-bucket only); omit for an unlimited link",
    )
    p.add_argument("--rtt-ms", type=float, default=0.0, help="added round-trip time (default: 0)")
    p.add_argument(
        "--shaper",
        default="token-bucket",
        help=f"one or a comma list of {', '.join(SHAPERS)}" + options.DEFAULT,
    )


def _load_arguments(p: argparse.ArgumentParser) -> None:
    """How chunks are loaded: at one level, adaptively within an SLO, or in chosen forms."""
    mode = p.add_mutually_exclusive_group()
    fixed = "load every chunk at this level (default: the codec's default)"
    mode.add_argument("--level", type=int, help=fixed)
    mode.add_argument(
        "--slo-ms",
        default=None,
        help="TTFT budget for the adaptive controller (a comma list with --controller-eval)",
    )
    mode.add_argument(
        "--forms",
        default=None,
        help="store these forms (a comma list of cachegen-<L>, cachegen-<L>-packed, raw, int8, "
        "fp8, lmcache-cachegen; 'default': the default level coded and packed, raw, int8, "
        "fp8), load each alone and with the adaptive choice of the fastest form allowed by the "
        "quality bound, and compare (--codec is not used)",
    )


def _forms_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-loss-pct",
        type=float,
        default=None,
        help="with --forms: the quality bound, the largest loss (perplexity change, %%) a form "
        "may have (default: the default cachegen level's calibrated loss)",
    )
    p.add_argument(
        "--loss-pct",
        default=None,
        help="with --forms: losses that override the data, NAME=PCT,... (a packed form has its "
        "coded level's loss), e.g. int8=0.1,cachegen-2=1.5",
    )
    p.add_argument(
        "--explore",
        type=float,
        default=0.0,
        help="with --forms: the adaptive load's trial margin (FastestController's explore; "
        "default 0: its decode priors are every form's rates measured just before, on this "
        "host at this rate, so a trial has nothing to learn)",
    )
    p.add_argument(
        "--switch-margin",
        type=float,
        default=None,
        help="with --forms: how much sooner (a fraction) another form must be predicted to "
        f"finish the load before a chunk leaves the previous chunk's form (default "
        f"{DEFAULT_SWITCH_MARGIN})",
    )


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    traces = "evaluate adaptive vs every fixed level vs recompute over constant/step/random-walk "
    options.switch(p, "--controller-eval", traces + "traces")
    p.add_argument(
        "--real-runs",
        type=int,
        default=1,
        help="with --controller-eval: traces of each kind also replayed over a real socket "
        "(default: 1)",
    )
    p.add_argument(
        "--drop-factor",
        default=None,
        help="with --controller-eval: the controller's drop factor(s), a comma list "
        f"(default: {DEFAULT_DROP_FACTOR})",
    )


def _check(args: argparse.Namespace) -> tuple[list[str], list]:
    """The shapers and bandwidths of the arguments, once they are known to go together."""
    if args.tokens <= 0 or args.chunk_tokens <= 0 or args.repeat <= 0:
        raise InputError("--tokens, --chunk-tokens and --repeat must be positive")
    shapers = [s.strip() for s in args.shaper.split(",")]
    unknown = [s for s in shapers if s not in SHAPERS]
    if unknown:
        raise InputError(f"unknown shaper {unknown[0]!r}; choose from {', '.join(SHAPERS)}")
    bandwidths = bench.parse_bandwidths(args.bandwidth_mbps)
    if args.forms is None and (
        args.max_loss_pct is not None
        or args.loss_pct is not None
        or args.explore
        or args.switch_margin is not None
    ):
        raise InputError(
            "--max-loss-pct, --loss-pct, --explore and --switch-margin go with --forms"
        )
    if args.explore < 0 or (args.switch_margin or 0) < 0:
        raise InputError(
            f"--explore and --switch-margin must be >= 0, got {args.explore} and "
            f"{args.switch_margin}"
        )
    if args.forms is not None and args.controller_eval:
        raise InputError("--controller-eval evaluates the SLO rule: give --slo-ms, not --forms")
    return shapers, bandwidths


def _stream_bench(args: argparse.Namespace) -> int:
    shapers, bandwidths = _check(args)
    with contextlib.closing(open_store(args.store)) as store:
        if args.forms is not None:
            result = _forms_bench(args, store, shapers, bandwidths)
        else:
            result = _levels_bench(args, store, shapers, bandwidths)
    result["command"] = options.command_line(
        ["cachegen", "stream-bench"], args, {"func", "command", "json"}
    )
    if args.forms is not None:
        print(forms.format_table(result), file=sys.stderr)
    elif args.json and not args.controller_eval:
        rows.validate(result["runs"], "stream", "stream-bench runs")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _levels_bench(args: argparse.Namespace, store, shapers, bandwidths) -> dict:
    """Load at one level, adaptively, or (``--controller-eval``) evaluate the controller."""
    from cachegen.profiles import codec_for

    codec = codec_for(args.codec, args.model)
    need_all_levels = args.controller_eval or args.slo_ms is not None
    level = (
        args.level if args.level is not None else (None if need_all_levels else codec.default_level)
    )
    levels = codec.levels if need_all_levels else [level]
    ids = bench.bench_tokens(models.resolve(args.model), args.tokens)
    prep = bench.prepare(store, args.model, args.codec, ids, args.chunk_tokens, levels)
    prefill_tps = args.prefill_tps or prep.prefill_tps
    if need_all_levels and not prefill_tps:
        prefill_tps, _ = bench.measure_prefill_tps(models.resolve(args.model), prep.token_ids)
    if not args.controller_eval:
        return bench.stream_bench(
            store,
            prep,
            shapers=shapers,
            bandwidths=bandwidths,
            rtt_ms=args.rtt_ms,
            level=level,
            slo_ms=_floats(args.slo_ms)[0] if args.slo_ms else None,
            prefill_tps=prefill_tps,
            repeat=args.repeat,
        )
    if args.slo_ms is None:
        raise InputError("--controller-eval needs --slo-ms (one or a comma list)")
    result = bench.controller_eval(
        store,
        prep,
        slos_ms=_floats(args.slo_ms),
        prefill_tps=prefill_tps,
        rtt_ms=args.rtt_ms,
        real_runs=args.real_runs,
        drop_factors=_floats(args.drop_factor or DEFAULT_DROP_FACTOR),
    )
    _print_eval(result)
    return result


def _forms_bench(args: argparse.Namespace, store, shapers, bandwidths) -> dict:
    from cachegen.profiles import codec_for

    spec = models.resolve(args.model)
    cachegen_codec = codec_for("cachegen", spec, chunk_tokens=args.chunk_tokens)
    chosen = forms.parse_forms(args.forms, cachegen_codec.default_level)
    losses = forms.form_losses(spec, cachegen_codec, chosen, forms.parse_losses(args.loss_pct))
    bound = (
        args.max_loss_pct if args.max_loss_pct is not None else forms.default_bound(cachegen_codec)
    )
    ids = bench.bench_tokens(spec, args.tokens)
    preps = forms.prepare_forms(store, args.model, chosen, ids, args.chunk_tokens)
    prefill_tps = args.prefill_tps or next(
        (p.prefill_tps for p in preps.values() if p.prefill_tps), None
    )
    if not prefill_tps:
        prefill_tps, _ = bench.measure_prefill_tps(spec, ids)
    return forms.forms_bench(
        store,
        preps,
        chosen,
        losses,
        max_loss_pct=bound,
        shapers=shapers,
        bandwidths=bandwidths,
        rtt_ms=args.rtt_ms,
        prefill_tps=prefill_tps,
        repeat=args.repeat,
        explore=args.explore,
        switch_margin=(DEFAULT_SWITCH_MARGIN if args.switch_margin is None else args.switch_margin),
    )


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in str(text).split(",")]
    except ValueError:
        raise InputError(f"expected numbers separated by commas, got {text!r}") from None


def _print_eval(result: dict) -> None:
    for ev in result["evaluations"]:
        feasible = ev["adaptive_hit_rate_where_feasible"]
        hit_rate = "n/a (no such trace)" if feasible is None else f"{feasible:.3f}"
        print(
            f"\nSLO {ev['slo_s'] * 1000:.0f} ms, drop factor {ev['drop_factor']:g}, "
            f"{len(ev['traces'])} traces; adaptive hit rate where some fixed level meets it: "
            f"{hit_rate}",
            file=sys.stderr,
        )
        head = ("policy", "SLO hit", "mean lvl", "recomp", "mean TTFT", "p95 TTFT")
        widths = (10, 8, 9, 7, 10, 9)
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths)), file=sys.stderr)
        for row in ev["summary"]:
            lvl = "-" if row["mean_level"] is None else f"{row['mean_level']:.2f}"
            print(
                f"{row['policy']:>10} {row['slo_hit_rate']:8.3f} {lvl:>9} "
                f"{row['recompute_share']:7.3f} {row['mean_ttft_s']:10.3f} "
                f"{row['p95_ttft_s']:9.3f}",
                file=sys.stderr,
            )
        for r in ev["real"]:
            print(
                f"  real socket, {r['trace']}: TTFT {r['real_ttft_s']:.3f} s "
                f"(simulated {r['sim_ttft_s']:.3f} s), mean level {r['real_mean_level'] or 0:.2f} "
                f"(simulated {r['sim_mean_level'] or 0:.2f})",
                file=sys.stderr,
            )
