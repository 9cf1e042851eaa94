"""What a server installs: the cachegen wheel alone (no lab module, no lab entry point), in a
fresh virtual environment with the lock's other packages, runs a connector round trip through
vLLM: a prompt stored, then loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.support import REPO

LAB_ENTRY_POINT_GROUPS = ("cachegen.codecs", "cachegen.commands", "cachegen.links")


def _source_tree(into: Path) -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore), without the
    build folders a former build left, which setuptools would put into the wheel again."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, into / name)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = _source_tree(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("cachegen-*.whl")
    return path


def test_the_servers_wheel_holds_no_lab_module_and_no_lab_entry_point(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points).decode()
    print(f"{wheel.name}: {len(names)} files; entry points:\n{declared}")
    assert not [n for n in names if n.startswith(("cachegen_lab/", "cachegen/lab/"))]
    assert all(n.startswith(("cachegen/", "cachegen-0.1.0.dist-info/")) for n in names)
    assert "cachegen/connector/connector.py" in names and "cachegen/codec/tcq/codec.py" in names
    assert not [group for group in LAB_ENTRY_POINT_GROUPS if f"[{group}]" in declared]
    modules = {n for n in names if n.endswith(".py")}
    assert modules == {str(p.relative_to(REPO)) for p in (REPO / "cachegen").rglob("*.py")}


def test_the_servers_wheel_requires_lmcache_only_in_its_extra(wheel):
    """``pip install cachegen`` pulls nothing of LMCache; ``cachegen[lmcache]`` does."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [
            line.removeprefix("Requires-Dist:").strip()
            for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]
    lmcache = [r for r in requires if r.lower().startswith("lmcache")]
    assert lmcache and all('extra == "lmcache"' in r for r in lmcache), requires


def _lock_packages_without_cachegen(into: Path) -> None:
    """Links to every package of this environment (the lock's) but the two of this
    repository, and their editable finders."""
    into.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if entry.name.lower().startswith(("cachegen", "__editable__", "__pycache__")):
            continue
        if entry.suffix == ".pth":
            continue
        (into / entry.name).symlink_to(entry)


def test_the_wheel_alone_stores_and_loads_through_vllm(wheel, tmp_path, tiny_llama):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    _lock_packages_without_cachegen(tmp_path / "lock")
    (site / "lock-packages.pth").write_text(f"{tmp_path / 'lock'}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + ["--no-index", str(wheel)],
        check=True,
        capture_output=True,
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [str(python), str(REPO / "tests/connector/wheel_round_trip.py")]
        + [str(tiny_llama.path), (tmp_path / "store").as_uri()],
        cwd=tmp_path,  # not the repository: its cachegen is not on the path
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    print(out)
    assert out["lab_modules"] == []
    assert out["cachegen_file"].startswith(str(site))  # the wheel's, not the checkout's
    assert not out["first"].get("loaded_tokens") and out["first"]["save_chunks"] == 2
    assert out["second"]["loaded_tokens"] == 512, out["second"]
