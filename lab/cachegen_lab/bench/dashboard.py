"""The asv dashboard, offline: local copies of the pages' JavaScript and CSS, and a check that a
benchmark's graph renders in headless Chromium with the network blocked.

``asv publish`` writes pages that load jQuery, flot, bootstrap and a few plugins from public
CDNs; without internet they show only asv's error page. ``localize`` copies the vendored files
(benchmarks/dashboard/vendor, listed with their sources and licences in its manifest.json) next
to the pages and points the pages at them. A page that still loads something from outside, with
no local copy listed in the manifest, is an error: an asv upgrade that adds or bumps a
dependency fails here instead of publishing a dashboard that breaks offline.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from cachegen.errors import CacheGenError
from cachegen.fileio import check_version, write_atomic

SCHEMA = "cachegen-dashboard-vendor"  # benchmarks/dashboard/vendor/manifest.json
VERSION = 1
DEFAULT_HTML_DIR = Path(".asv/html")
DEFAULT_VENDOR_DIR = Path("benchmarks/dashboard/vendor")
LOCAL_DIR = "vendor"  # under the html directory, next to the pages
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
# Chromium resolves no host name except the loopback address the pages are served from.
BLOCK_NETWORK = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
# From asv's error.html, where its pages go when a script fails to load.
ERROR_PAGE_TEXT = "dependencies of airspeed velocity failed to load"
# flot draws its canvas even with no data; axis labels appear only around plotted data.
PLOT_CANVAS = re.compile(r"<canvas\b[^>]*\bclass=\"flot-base\"")
AXIS_LABEL = "flot-tick-label"
ERROR_MODAL = re.compile(r"id=\"error-message\"[^>]*>([^<]*)<")  # asv's own error dialog

_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)
_TAG = re.compile(r"<(?:script|link|img|iframe|source|embed)\b[^>]*>", re.IGNORECASE)
_ATTR = re.compile(r"(\s)([a-zA-Z:-]+)(\s*=\s*)(\"[^\"]*\"|'[^']*'|[^\s\"'>]+)")
_CSS_URL = re.compile(r"(?:url\(\s*|@import\s+)[\"']?((?:[a-z]+:)?//[^\"')\s]+)", re.IGNORECASE)
# The CDNs' integrity hashes name the CDN's bytes (flot's vendored sources are not cdnjs's
# minified build), and integrity/crossorigin make Chromium refuse same-origin files opened
# over file://. localize checks every vendored file against the manifest's sha256 instead.
_CDN_ONLY_ATTRS = {"integrity", "crossorigin", "referrerpolicy"}


class DashboardError(CacheGenError):
    """The dashboard cannot be made to work offline, or does not render."""


@dataclass(frozen=True)
class VendorFile:
    path: str  # relative to the vendor directory
    sha256: str
    replaces: str | None  # the CDN URL asv's pages load it from; None for licences, fonts


@dataclass(frozen=True)
class LocalizeResult:
    pages: list[Path]  # pages rewritten
    replaced: int  # CDN references pointed at local copies
    copied: int  # vendored files copied next to the pages


@dataclass(frozen=True)
class CheckResult:
    url: str
    benchmark: str
    canvases: int
    screenshot: Path


def load_manifest(vendor_dir: Path = DEFAULT_VENDOR_DIR) -> list[VendorFile]:
    """The vendored files, each checked against the manifest's sha256."""
    vendor_dir = Path(vendor_dir)
    path = vendor_dir / "manifest.json"
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise DashboardError(
            f"{path} not found: pass --vendor-dir, the directory with the dashboard's vendored "
            "files (benchmarks/dashboard/vendor in the repository)"
        ) from None
    except json.JSONDecodeError as exc:
        raise DashboardError(f"{path} is not valid JSON: {exc}") from None
    check_version(doc, SCHEMA, (VERSION,), str(path))
    try:
        files = [
            VendorFile(f["path"], f["sha256"], f.get("replaces"))
            for package in doc["packages"]
            for f in package["files"]
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        raise DashboardError(
            f"{path} is malformed ({exc!r}): restore it from the repository"
        ) from None
    for f in files:
        _verify(vendor_dir / f.path, f.sha256)
    return files


def _verify(path: Path, sha256: str) -> None:
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        raise DashboardError(f"{path} is listed in manifest.json but missing") from None
    if digest != sha256:
        raise DashboardError(
            f"{path} does not match manifest.json (sha256 {digest}, listed {sha256}): restore it "
            "from the source the manifest names"
        )


def localize(
    html_dir: Path = DEFAULT_HTML_DIR, vendor_dir: Path = DEFAULT_VENDOR_DIR
) -> LocalizeResult:
    """Copy the vendored files into ``html_dir``/vendor and point every page at them.

    Everything is checked before anything is written: an external reference with no local copy
    raises ``DashboardError`` and leaves ``html_dir`` as it was."""
    html_dir, vendor_dir = Path(html_dir), Path(vendor_dir)
    if not (html_dir / "index.html").is_file():
        raise DashboardError(f"{html_dir}/index.html not found: run `asv publish` first")
    files = load_manifest(vendor_dir)
    local = {f.replaces: html_dir / LOCAL_DIR / f.path for f in files if f.replaces}
    rewritten: dict[Path, str] = {}
    missing: dict[str, list[Path]] = {}
    replaced = 0
    for page in _site_files(html_dir, ".html"):
        text, count, unknown = _rewrite_page(page.read_text(), page.parent, local)
        replaced += count
        if count:
            rewritten[page] = text
        for url in unknown:
            missing.setdefault(url, []).append(page)
    for sheet in _site_files(html_dir, ".css"):
        for url in _CSS_URL.findall(sheet.read_text()):
            missing.setdefault(url, []).append(sheet)
    if missing:
        raise DashboardError(_missing_message(missing, html_dir, vendor_dir))
    for f in files:
        write_atomic(html_dir / LOCAL_DIR / f.path, (vendor_dir / f.path).read_bytes())
    write_atomic(
        html_dir / LOCAL_DIR / "manifest.json", (vendor_dir / "manifest.json").read_bytes()
    )
    for page, text in rewritten.items():
        write_atomic(page, text.encode())
    return LocalizeResult(sorted(rewritten), replaced, len(files))


def _site_files(html_dir: Path, suffix: str) -> list[Path]:
    """asv's own files of one kind (not the vendored copies)."""
    local = html_dir / LOCAL_DIR
    return sorted(p for p in html_dir.rglob(f"*{suffix}") if local not in p.parents)


def _rewrite_page(text: str, page_dir: Path, local: dict[str, Path]) -> tuple[str, int, list[str]]:
    """``text`` with every external src (and <link href>) that has a local copy pointed at it;
    the number replaced and the external URLs that have none."""
    replaced, unknown = 0, []

    def tag(match: re.Match) -> str:
        nonlocal replaced
        attrs = {name.lower(): value.strip("\"'") for _, name, _, value in _ATTR.findall(match[0])}
        url_attr = "src" if "src" in attrs else "href"
        url = attrs.get(url_attr, "")
        if not _EXTERNAL.match(url):
            return match[0]
        if url not in local:
            unknown.append(url)
            return match[0]
        replaced += 1
        relative = Path(os.path.relpath(local[url], page_dir)).as_posix()
        return _ATTR.sub(functools.partial(_attr, url_attr, relative), match[0])

    return _TAG.sub(tag, text), replaced, unknown


def _attr(url_attr: str, relative: str, match: re.Match) -> str:
    space, name, equals, _ = match.groups()
    if name.lower() in _CDN_ONLY_ATTRS:
        return ""
    if name.lower() == url_attr:
        return f'{space}{name}{equals}"{relative}"'
    return match[0]


def _missing_message(missing: dict[str, list[Path]], html_dir: Path, vendor_dir: Path) -> str:
    lines = [
        f"{url} (in {', '.join(str(p.relative_to(html_dir)) for p in pages)})"
        for url, pages in sorted(missing.items())
    ]
    return (
        f"the dashboard in {html_dir} loads files from outside that have no local copy, so it "
        "would not work offline:\n  "
        + "\n  ".join(lines)
        + f"\nvendor each (with its licence) under {vendor_dir} and list it in its "
        "manifest.json (docs/benchmarks.md, 'The dashboard, offline'); nothing was changed"
    )


def find_chromium(explicit: str | None = None) -> str:
    """The Chromium binary: ``explicit`` if given, else the first of CHROMIUM_NAMES on PATH."""
    for name in (explicit,) if explicit else CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise DashboardError(
        f"{explicit or 'chromium'} not found: install Chromium (Debian/Ubuntu: "
        "sudo apt-get install chromium) or pass --chromium PATH"
    )


def default_benchmark(html_dir: Path = DEFAULT_HTML_DIR) -> str:
    """The first benchmark (by name) that the published dashboard has a graph for."""
    index = Path(html_dir) / "index.json"
    try:
        names = sorted(json.loads(index.read_text())["benchmarks"])
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        raise DashboardError(f"{index} is missing or not asv's index: run `asv publish`") from None
    graphs = {p.stem for p in (Path(html_dir) / "graphs").rglob("*.json")}
    for name in names:
        if name in graphs:
            return name
    raise DashboardError(f"the dashboard in {html_dir} has no benchmark graphs: run `asv run`")


def check(
    html_dir: Path = DEFAULT_HTML_DIR,
    screenshot: Path = Path("dashboard.png"),
    benchmark: str | None = None,
    chromium: str | None = None,
    budget_ms: int = 5000,
    timeout_s: float = 120.0,
) -> CheckResult:
    """Open ``benchmark``'s graph page in headless Chromium with the network blocked, save a
    screenshot, and raise ``DashboardError`` unless the graph rendered: not asv's error page or
    error dialog, a flot plot canvas with axis labels."""
    html_dir = Path(html_dir)
    binary = find_chromium(chromium)
    benchmark = benchmark or default_benchmark(html_dir)
    with serve(html_dir) as base_url:
        url = f"{base_url}index.html#{benchmark}"
        dom = render(binary, url, Path(screenshot), budget_ms, timeout_s)
    if ERROR_PAGE_TEXT in dom:
        raise DashboardError(
            f"{url} showed asv's error page: a dependency failed to load without the network; "
            f"run `cachegen dashboard localize --html-dir {html_dir}` after `asv publish`"
        )
    shown = ERROR_MODAL.search(dom)
    if shown and shown[1].strip():
        raise DashboardError(f"{url} showed asv's error message: {shown[1].strip()}")
    canvases = len(PLOT_CANVAS.findall(dom))
    if not canvases or AXIS_LABEL not in dom:
        raise DashboardError(
            f"{url} drew no graph for {benchmark}: {canvases} plot canvases, "
            f"{'axis labels' if AXIS_LABEL in dom else 'no axis labels'} (screenshot: {screenshot})"
        )
    return CheckResult(url, benchmark, canvases, Path(screenshot))


@contextmanager
def serve(directory: Path) -> Iterator[str]:
    """Serve ``directory`` over HTTP on a free loopback port (asv's pages fetch their JSON, which
    Chromium refuses over file://); yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass


def render(binary: str, url: str, screenshot: Path, budget_ms: int, timeout_s: float) -> str:
    """The DOM of ``url`` after ``budget_ms`` of virtual time in headless Chromium with the
    network blocked; the window's screenshot is written to ``screenshot``."""
    screenshot = screenshot.resolve()
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(
        prefix="cachegen-chromium-", ignore_cleanup_errors=True
    ) as profile:
        command = [
            binary,
            "--headless",
            "--no-sandbox",  # the sandbox refuses to run as root (CI)
            "--disable-gpu",
            "--disable-dev-shm-usage",  # containers' /dev/shm is often too small
            "--no-first-run",
            f"--user-data-dir={profile}",
            BLOCK_NETWORK,
            "--window-size=1280,900",
            f"--virtual-time-budget={budget_ms}",
            f"--screenshot={screenshot}",
            "--dump-dom",
            url,
        ]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise DashboardError(f"{binary} did not finish {url} in {timeout_s:g} s") from None
    if done.returncode != 0 or not done.stdout.strip():
        raise DashboardError(
            f"{binary} failed on {url} (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
        )
    return done.stdout
