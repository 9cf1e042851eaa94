"""``cachegen dashboard``: make the asv dashboard work offline, and check that it does."""

from __future__ import annotations

import argparse
from pathlib import Path

from cachegen.lab.bench import dashboard

DEFAULT_SCREENSHOT = Path("benchmarks/dashboard.png")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "dashboard",
        help="point the asv dashboard at local copies of its JavaScript and CSS; check it offline",
        description="After `asv publish`: `localize` copies the vendored JavaScript and CSS "
        "(benchmarks/dashboard/vendor) next to the pages and rewrites their CDN URLs, failing if "
        "a page loads something with no local copy; `check` opens a benchmark's graph in "
        "headless Chromium with the network blocked, saves a screenshot, and fails unless the "
        "graph renders.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    localize = actions.add_parser(
        "localize", help="use local copies of the pages' JavaScript and CSS"
    )
    _html_dir(localize)
    localize.add_argument(
        "--vendor-dir",
        type=Path,
        default=dashboard.DEFAULT_VENDOR_DIR,
        help="the vendored files and their manifest.json (default: %(default)s)",
    )
    localize.set_defaults(func=run_localize)
    check = actions.add_parser(
        "check", help="open a benchmark's graph in headless Chromium, offline; save a screenshot"
    )
    _html_dir(check)
    check.add_argument(
        "--screenshot",
        type=Path,
        default=DEFAULT_SCREENSHOT,
        help="where to save the screenshot (default: %(default)s)",
    )
    check.add_argument(
        "--benchmark",
        help="the benchmark whose graph to open, e.g. codec.CodecSpeed.time_decode (default: "
        "the first one with a graph)",
    )
    check.add_argument("--chromium", help="the Chromium binary (default: chromium on PATH)")
    check.add_argument(
        "--budget-ms",
        type=int,
        default=5000,
        help="virtual time the page gets to load and draw (default: %(default)s)",
    )
    check.set_defaults(func=run_check)


def _html_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--html-dir",
        type=Path,
        default=dashboard.DEFAULT_HTML_DIR,
        help="what `asv publish` wrote (default: %(default)s)",
    )


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
