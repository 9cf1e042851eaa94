"""What the commands that measure through vLLM (``cachegen ttft``, ``cachegen experiment
window|repeat``) write: their tables on stdout and, when asked, the tables to a markdown file
and every row to a JSON document (schema and version)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cachegen.fileio import versioned, write_atomic

# 2: a ttft table row's level may name a packed form (cachegen-11-packed); 3: a row's mode may
# be lmcache-cachegen (the lab's peer codec)
VERSION = 3


def add_outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", type=Path, help="also write every row to this JSON file (schema and version)"
    )
    p.add_argument(
        "--markdown", type=Path, help="also write the tables to this file (vLLM logs to stdout)"
    )


def emit(
    args: argparse.Namespace, rows: list[dict], text: str, schema: str, kind: str | None
) -> int:
    """Print ``text``; write it to ``--markdown`` and ``rows`` as a ``schema`` document to
    ``--json`` (each row checked as a ``kind`` row of rows.schema.json; None: not one)."""
    print(text)
    if args.markdown:
        write_atomic(args.markdown, (text + "\n").encode())
    if args.json:
        from cachegen_lab import rows as row_schema

        if kind is not None:
            row_schema.validate(rows, kind, str(args.json))
        document = versioned(schema, VERSION, {"rows": rows})
        write_atomic(args.json, (json.dumps(document, indent=1) + "\n").encode())
    return 0
