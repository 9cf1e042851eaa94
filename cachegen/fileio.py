"""Writing files so that readers never see half of one, and versioned JSON documents."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cachegen.errors import InputError


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same directory, renamed into
    place; on any failure the temporary file is removed and ``path`` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; these are ordinary shared files
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# Every JSON document the project writes or ships starts with "schema" (what it is) and
# "version" (of that schema); readers refuse what they do not know instead of misreading it.


def versioned(schema: str, version: int, body: dict) -> dict:
    """``body`` stamped with its schema name and version (first, for readers of the file)."""
    return {"schema": schema, "version": version, **body}


def check_version(doc: object, schema: str, versions: tuple[int, ...], where: str) -> dict:
    """``doc`` if it is a ``schema`` document of one of ``versions``; otherwise an
    ``InputError`` that says what it is and what this cachegen reads."""
    if not isinstance(doc, dict):
        raise InputError(f"{where} is not a JSON object; expected a {schema!r} document")
    found, version = doc.get("schema"), doc.get("version")
    if found != schema:
        raise InputError(
            f"{where} is a {found!r} document, not {schema!r}"
            if found
            else f'{where} has no "schema" field; expected a {schema!r} document'
        )
    if version not in versions:
        known = ", ".join(str(v) for v in versions)
        raise InputError(
            f"{where} is {schema!r} version {version!r}; this cachegen reads version {known}: "
            "regenerate the file with this cachegen, or use the cachegen that wrote it"
        )
    return doc
