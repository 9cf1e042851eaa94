"""``cachegen bench``, ``cachegen plot`` and ``cachegen report``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from cachegen.cli import options
from cachegen.cli.options import DEFAULT
from cachegen.errors import InputError

DEFAULT_RESULTS = Path("benchmarks/results.json")
DEFAULT_REPORT = Path("docs/reproduction.md")
# the flags that override the profile's sweep, each passed on as is (and --parts, a tuple)
OVERRIDES = (
    "models",
    "modes",
    "bandwidth_mbps",
    "context_tokens",
    "repeats",
    "output_tokens",
    "quality_windows",
    "slo_ms",
)


def register(subparsers) -> None:
    _register_bench(subparsers)
    p = options.command(
        subparsers,
        "plot",
        _plot,
        help="draw the benchmark figures (PNG) from results.json, a stored-forms or a "
        "fleet-bench document",
        description="Draw TTFT by model and mode, TTFT vs bandwidth, output rate, compression "
        "ratio, transfer time vs bandwidth, decode time, and quality vs size with its Pareto "
        "frontier from results.json; from a `cachegen stream-bench --forms --json` document, "
        "load time per stored form and adaptive's vs bandwidth; from a `cachegen ttft table "
        "--json` document, TTFT per mode vs bandwidth (each as FILE's name with .png); from a "
        "`cachegen fleet-bench --json` document, TTFT p50/p90/p99 per run (fleet_ttft.png) and "
        "requests/s and output tokens/s per run (fleet_throughput.png).",
    )
    _results(p, "results.json, a stream-bench --forms, a ttft table or a fleet-bench document")
    p.add_argument(
        "--out", type=Path, help="directory for the PNGs (default: the results file's directory)"
    )
    p = options.command(
        subparsers,
        "report",
        _report,
        help="write the reproduction report (paper's claims vs measurements) from results.json",
        description="Render docs/reproduction.md: each claim of the CacheGen paper beside what "
        "results.json measured.",
    )
    _results(p, "results file")
    p.add_argument(
        "--out", type=Path, default=DEFAULT_REPORT, help="markdown file to write" + DEFAULT
    )


def _results(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("results", nargs="?", type=Path, default=DEFAULT_RESULTS, help=help + DEFAULT)


def _register_bench(subparsers) -> None:
    p = options.command(
        subparsers,
        "bench",
        _bench,
        help="run the end-to-end benchmark sweep and write results.json",
        description="Measure TTFT, latency and output rate through vLLM (text recompute and every "
        "KV mode through the CacheGenConnector), compression, transfer and decode time through "
        "the codec and a rate-limited socket, and quality with decoded KV; write results.json and "
        "print a summary. Flags override the profile.",
    )
    p.add_argument(
        "--profile",
        choices=("default", "quick"),
        default="default",
        help="default: what `make bench` runs (both embedded models; its time on 2 cores is in "
        "docs/benchmarks.md); quick: a smoke run (the default model, one short context)",
    )
    p.add_argument(
        "--quick",
        action="store_const",
        const="quick",
        dest="profile",
        help="same as --profile quick",
    )
    _sweep_overrides(p)
    p.add_argument("--output", type=Path, default=DEFAULT_RESULTS, help="results file" + DEFAULT)
    p.add_argument("--plots", type=Path, metavar="DIR", help="also draw the figures into DIR")
    options.switch(p, "--verbose", "show vLLM's log on stderr")
    options.json_flag(p, "print the median rows as JSON instead of tables")


def _sweep_overrides(p: argparse.ArgumentParser) -> None:
    """The flags that override the profile's sweep (None: the profile's)."""
    p.add_argument(
        "--models",
        nargs="+",
        help="model names, hub ids or directories (default: smollm2-135m, plus "
        "$CACHEGEN_BENCH_MODELS)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        help="recompute raw int8 fp8 cachegen-<level> tcq-<level> adaptive adaptive-fastest, or "
        "the groups baseline (recompute raw int8 fp8), cachegen (paper levels 1-3, the model's "
        "default level, adaptive), tcq (the model's tcq default level, adaptive-fastest over the "
        "connector's default save ladder), all (default: recompute raw int8 cachegen tcq)",
    )
    rates = "link rates in Mbit/s (default: 100 500 1000)"
    p.add_argument("--bandwidth-mbps", nargs="+", type=float, help=rates)
    lengths = "context lengths in tokens (default: 1536 4096)"
    p.add_argument("--context-tokens", nargs="+", type=int, help=lengths)
    repeats = "measurements per cell; results keep each and their median (default: 3)"
    p.add_argument("--repeats", type=int, help=repeats)
    p.add_argument("--output-tokens", type=int, help="tokens generated per request (default: 16)")
    windows = "text windows for the quality part (0 skips it)"
    p.add_argument("--quality-windows", type=int, help=windows)
    p.add_argument(
        "--slo-ms", type=float, help="load-time budget of the adaptive mode (default: 1000)"
    )
    parts = ("e2e", "stream", "quality")
    p.add_argument("--parts", nargs="+", choices=parts, help="what to measure (default: all three)")


def _bench(args: argparse.Namespace) -> int:
    from cachegen_lab.bench import results
    from cachegen_lab.bench.summary import print_summary
    from cachegen_lab.bench.sweep import profile, run_sweep

    parts = tuple(args.parts) if args.parts else None
    cfg = profile(args.profile, **options.values(args, *OVERRIDES), parts=parts)
    doc = run_sweep(
        cfg,
        command=_command_line(args),
        progress=sys.stderr.isatty(),
        log=sys.stderr if args.verbose else None,
    )
    path = results.save(doc, args.output)
    if args.json:
        print(json.dumps(doc["medians"], indent=1))
    else:
        print_summary(doc)
    print(f"results: {path}", file=sys.stderr)
    if args.plots:
        from cachegen_lab.bench.plots import plot_all

        for png in plot_all(doc, args.plots):
            print(f"figure: {png}", file=sys.stderr)
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """The bench command as given (rebuilt from the parsed flags), for results.json."""
    words = ["cachegen", "bench", "--profile", args.profile]
    for flag in (*OVERRIDES, "parts"):
        value = getattr(args, flag)
        if value is None:
            continue
        words.append("--" + flag.replace("_", "-"))
        words += [
            f"{v:g}" if isinstance(v, float) else str(v)
            for v in (value if isinstance(value, list) else [value])
        ]
    words += ["--output", str(args.output)]
    return " ".join(shlex.quote(w) for w in words)


def _plot(args: argparse.Namespace) -> int:
    from cachegen_lab.bench import results
    from cachegen_lab.bench.document_plots import DOCUMENTS, plot_document
    from cachegen_lab.bench.plots import plot_all
    from cachegen_lab.fleet import summary as fleet
    from cachegen_lab.fleet.plots import plot_fleet

    out = args.out or args.results.parent
    try:
        doc = json.loads(args.results.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        doc = None  # results.load says what is wrong with it
    schema = doc.get("schema") if isinstance(doc, dict) else None
    readable = (results.SCHEMA_NAME, *DOCUMENTS, fleet.SCHEMA)
    if schema is not None and schema not in readable:
        raise InputError(
            f"{args.results} is a {schema!r} document; cachegen plot reads {', '.join(readable)}"
        )
    if schema == fleet.SCHEMA:
        pngs = plot_fleet(doc, out, str(args.results))
    elif schema in DOCUMENTS:
        pngs = [plot_document(doc, Path(out) / f"{args.results.stem}.png", str(args.results))]
    else:
        pngs = plot_all(results.load(args.results), out)
    for png in pngs:
        print(png)
    return 0


def _report(args: argparse.Namespace) -> int:
    from cachegen_lab.bench import reproduction as report
    from cachegen_lab.bench import results

    doc = results.load(args.results)
    print(report.write(doc, str(args.results), args.out))
    return 0
