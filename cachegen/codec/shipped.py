"""What ships with the package for a model, found by its weights fingerprint: its calibrated
levels document, ``cachegen/codec/calibrated/<model>.json`` (cachegen's calibrated levels and
default level, and the tcq calibration where one ships). Reading it runs no model and fits
nothing, so it is cheap enough to decide a server's defaults with.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cachegen.codec.cachegen.profile import SHIPPED_DIR, SHIPPED_SCHEMA, SHIPPED_VERSION
from cachegen.codec.errors import CodecError
from cachegen.fileio import check_version


def shipped_calibration(fingerprint: str) -> dict[str, Any] | None:
    """The calibrated levels document shipped for the model with weights ``fingerprint``
    (``ModelIdentity.fingerprint``); None for a model that ships none."""
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        doc = read_versioned(path, SHIPPED_SCHEMA, SHIPPED_VERSION)
        if doc["model"]["fingerprint"] == fingerprint:
            return doc
    return None


def ships_tcq_default(fingerprint: str) -> bool:
    """Whether the model with weights ``fingerprint`` ships a tcq calibration with a default
    level (the ``tcq`` entry of its document, ``cachegen.codec.tcq.levels``)."""
    doc = shipped_calibration(fingerprint) or {}
    return (doc.get("tcq") or {}).get("default_level") is not None


def read_versioned(path: Path, schema: str, version: int) -> dict[str, Any]:
    """The versioned JSON document at ``path`` (``CodecError`` when it is unreadable)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CodecError(f"{path} is unreadable ({exc}); reinstall cachegen") from exc
    return check_version(doc, schema, (version,), str(path))
