"""The asv dashboard works offline: a real `asv publish` of a one-benchmark project, localized,
opened in headless Chromium with the network blocked."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import asv
import pytest

from cachegen.cli import main
from cachegen_lab.bench import dashboard
from tests.support import REPO, require_tool

VENDOR_DIR = REPO / "benchmarks" / "dashboard" / "vendor"
BENCHMARK = "tiny.track_answer"
ASV_CONF = {
    "version": 1,
    "project": "tiny",
    "repo": ".",
    "branches": ["main"],
    "dvcs": "git",
    "environment_type": "existing",
    "benchmark_dir": "benchmarks",
    "results_dir": "results",
    "html_dir": "html",
}


@pytest.fixture(scope="module")
def chromium() -> str:
    """The first of dashboard.CHROMIUM_NAMES on PATH; fails (not skips) without any, as the
    Redis tests do: .ci/run installs it."""
    found = [path for path in map(shutil.which, dashboard.CHROMIUM_NAMES) if path]
    return found[0] if found else require_tool("chromium")


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """What `asv publish` writes for a git project with one track benchmark run once."""
    project = tmp_path_factory.mktemp("asv-project")
    (project / "benchmarks").mkdir()
    (project / "benchmarks" / "__init__.py").write_text("")
    (project / "benchmarks" / "tiny.py").write_text("def track_answer():\n    return 42\n")
    (project / "asv.conf.json").write_text(json.dumps(ASV_CONF))
    # asv keeps its machine file in $HOME; git needs an author.
    env = {**os.environ, "HOME": str(project), "GIT_AUTHOR_NAME": "t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_EMAIL": "t@example.org"}

    def run(*command: str) -> str:
        done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}: {done.stdout}{done.stderr}"
        return done.stdout.strip()

    run("git", "init", "-q", "-b", "main")
    run("git", "add", "-A")
    run("git", "commit", "-q", "-m", "tiny")
    asv_cli = (sys.executable, "-m", "asv")
    machine = ("--machine", "tiny")
    run(*asv_cli, "machine", "--yes", *machine)
    commit = run("git", "rev-parse", "HEAD")
    run(*asv_cli, "run", "--python=same", "--quick", *machine, "--set-commit-hash", commit)
    run(*asv_cli, "publish")
    return project / "html"


@pytest.fixture
def site(published, tmp_path) -> Path:
    """A fresh copy of the published dashboard for one test to change."""
    return Path(shutil.copytree(published, tmp_path / "html"))


def test_published_dashboard_needs_the_network(site, chromium, tmp_path):
    """asv's pages as published load their scripts from CDNs: blocked, they show asv's error
    page, and the check says so."""
    with pytest.raises(dashboard.DashboardError, match="error page"):
        dashboard.check(site, tmp_path / "shot.png", BENCHMARK, chromium, budget_ms=3000)


def test_localized_dashboard_renders_offline(site, chromium, tmp_path):
    shot = tmp_path / "out" / "dashboard.png"
    assert main(["dashboard", "localize", "--html-dir", str(site)]) == 0
    index = (site / "index.html").read_text()
    assert not re.search(r"(?:src|href)=\"(?:https?:)?//", index.split("<body")[0])
    assert (site / "vendor" / "jquery-3.3.1" / "jquery.min.js").is_file()
    assert (site / "vendor" / "manifest.json").is_file()

    args = ["dashboard", "check", "--html-dir", str(site), "--screenshot", str(shot)]
    assert main([*args, "--benchmark", BENCHMARK, "--chromium", chromium]) == 0
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert dashboard.default_benchmark(site) == BENCHMARK  # the only one with a graph


def test_localize_is_idempotent(site):
    dashboard.localize(site, VENDOR_DIR)
    before = (site / "index.html").read_bytes()
    again = dashboard.localize(site, VENDOR_DIR)
    assert again.replaced == 0 and again.pages == []
    assert (site / "index.html").read_bytes() == before


def test_localize_refuses_a_dependency_without_local_copy(site):
    """An asv upgrade that loads something new fails the step, and nothing is changed."""
    index = site / "index.html"
    new = '<script src="https://cdn.example.org/new-dep@1.0/new.min.js"></script>'
    index.write_text(index.read_text().replace("</head>", f"{new}\n</head>"))
    before = index.read_bytes()
    with pytest.raises(dashboard.DashboardError, match=r"new-dep@1\.0/new\.min\.js.*index\.html"):
        dashboard.localize(site, VENDOR_DIR)
    assert index.read_bytes() == before
    assert not (site / "vendor").exists()


def test_localize_refuses_a_changed_vendored_file(site, tmp_path):
    vendor = Path(shutil.copytree(VENDOR_DIR, tmp_path / "vendor"))
    script = vendor / "jquery-3.3.1" / "jquery.min.js"
    script.write_bytes(script.read_bytes() + b"\n")
    with pytest.raises(dashboard.DashboardError, match="does not match manifest.json"):
        dashboard.localize(site, vendor)
    assert not (site / "vendor").exists()


def test_manifest_covers_the_installed_asv():
    """Every CDN file asv's page template loads has a vendored copy, and every copy said to be
    the CDN's bytes has the integrity hash asv pins for that URL."""
    template = (Path(asv.__file__).parent / "www" / "index.html").read_text()
    pinned = dict(re.findall(r'(?:src|href)="(https://[^"]+)" integrity="([^"]+)"', template))
    manifest = json.loads((VENDOR_DIR / "manifest.json").read_text())
    assert (manifest["schema"], manifest["version"]) == (dashboard.SCHEMA, dashboard.VERSION)
    files = [f for package in manifest["packages"] for f in package["files"]]
    assert {f["replaces"] for f in files if "replaces" in f} == set(pinned)
    for f in files:
        if f.get("same_bytes_as_cdn"):
            algorithm = pinned[f["replaces"]].split("-")[0]
            digest = hashlib.new(algorithm, (VENDOR_DIR / f["path"]).read_bytes()).digest()
            assert f"{algorithm}-{base64.b64encode(digest).decode()}" == pinned[f["replaces"]]
    for package in manifest["packages"]:
        assert package["license"] and (package["license_file"] or package["note"])
