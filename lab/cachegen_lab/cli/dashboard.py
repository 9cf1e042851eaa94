"""``cachegen dashboard``: make the asv dashboard work offline, and check that it does."""

from __future__ import annotations

import argparse
from pathlib import Path

from cachegen.cli import options
from cachegen_lab.bench import dashboard

DEFAULT_SCREENSHOT = Path("benchmarks/dashboard.png")


def register(subparsers) -> None:
    p = options.command(
        subparsers,
        "dashboard",
        None,
        help="point the asv dashboard at local copies of its JavaScript and CSS; check it offline",
        description="After `asv publish`: `localize` copies the vendored JavaScript and CSS "
        "(benchmarks/dashboard/vendor) next to the pages and rewrites their CDN URLs, failing if "
        "a page loads something with no local copy; `check` opens a benchmark's graph in "
        "headless Chromium with the network blocked, saves a screenshot, and fails unless the "
        "graph renders.",
    )
    actions = options.actions(p)
    localize = _action(
        actions, "localize", run_localize, "use local copies of the pages' JavaScript and CSS"
    )
    vendored = "the vendored files and their manifest.json"
    _path(localize, "--vendor-dir", dashboard.DEFAULT_VENDOR_DIR, vendored)
    check = _action(
        actions,
        "check",
        run_check,
        "open a benchmark's graph in headless Chromium, offline; save a screenshot",
    )
    _path(check, "--screenshot", DEFAULT_SCREENSHOT, "where to save the screenshot")
    check.add_argument(
        "--benchmark",
        help="the benchmark whose graph to open, e.g. codec.CodecSpeed.time_decode (default: "
        "the first one with a graph)",
    )
    check.add_argument("--chromium", help="the Chromium binary (default: chromium on PATH)")
    budget = "virtual time the page gets to load and draw"
    options.integer(check, "--budget-ms", 5000, budget)


def _action(actions, name: str, handler, help: str) -> argparse.ArgumentParser:
    """An action of the dashboard command: every one reads what `asv publish` wrote."""
    p = options.command(actions, name, handler, help)
    _path(p, "--html-dir", dashboard.DEFAULT_HTML_DIR, "what `asv publish` wrote")
    return p


def _path(p: argparse.ArgumentParser, flag: str, default: Path, help: str) -> None:
    p.add_argument(flag, type=Path, default=default, help=help + options.DEFAULT)


def run_localize(args: argparse.Namespace) -> int:
    result = dashboard.localize(args.html_dir, args.vendor_dir)
    print(
        f"dashboard: {result.replaced} CDN references in {len(result.pages)} pages now load "
        f"{args.html_dir}/{dashboard.LOCAL_DIR}/ ({result.copied} vendored files)"
    )
    return 0


def run_check(args: argparse.Namespace) -> int:
    result = dashboard.check(
        args.html_dir, args.screenshot, args.benchmark, args.chromium, args.budget_ms
    )
    print(
        f"dashboard: {result.benchmark} renders offline ({result.canvases} plot canvases); "
        f"screenshot: {result.screenshot}"
    )
    return 0
