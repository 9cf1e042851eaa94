"""Which sources a tcq fit depends on, and the digest of them that the last refit check
passed with (``make check-refit``: tests/codec/test_shipped_tcq.py's refit, about six
minutes on two cores, so not in ``make test``). A test in ``make test`` compares the digest:
a change to any of these files fails it until the refit check has passed on the change."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from tests.support import REPO

# what a fit reads, runs or writes: the fitter, the tcq model file and its coding, the
# transform basis and rotation, the KV extraction, the calibration text
FIT_SOURCES = (
    "cachegen/fitting",
    "cachegen/codec/tcq",
    "cachegen/codec/transform",
    "cachegen/extract.py",
    "cachegen/workload",
)
RECORD = Path(__file__).with_name("refit_checked.json")
RECORD_ENV = "CACHEGEN_RECORD_REFIT"  # set by `make check-refit`: a passing refit records


def fit_sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(_source_files()):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _source_files() -> list[Path]:
    """The tracked files under FIT_SOURCES (not what a build or a run leaves beside them)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", *FIT_SOURCES], cwd=REPO, capture_output=True, check=True
    )
    return [REPO / name for name in out.stdout.decode().split("\0") if name]


def recorded_digest() -> str | None:
    return json.loads(RECORD.read_text())["fit_sources_sha256"] if RECORD.exists() else None


def record_digest() -> None:
    body = {"fit_sources_sha256": fit_sources_digest(), "sources": list(FIT_SOURCES)}
    document = {"schema": "cachegen-refit-checked", "version": 1, **body}
    RECORD.write_text(json.dumps(document, indent=1) + "\n")
