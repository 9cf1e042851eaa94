"""results.json: build, validate against ``results.schema.json``, summarize, save and load.

The schema files are the documentation of the format (runs and quality rows are rows of
``rows.schema.json``); ``validate`` checks a document against them with ``jsonschema`` and
then checks what a schema cannot say (medians match the runs).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import statistics
from functools import lru_cache
from pathlib import Path

from cachegen.errors import InputError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen_lab import rows

SCHEMA_PATH = Path(__file__).with_name("results.schema.json")
SCHEMA_NAME = "cachegen-bench-results"
# 2: rows of rows.schema.json, output_tokens_per_s; 3: tcq, adaptive-fastest; 4: the lab's peer
# lmcache-cachegen, config.mode_bandwidth_mbps
SCHEMA_VERSION = 4
READ_VERSIONS = (2, 3, SCHEMA_VERSION)  # each is the next without the next's modes and keys
CELL = ("kind", "model", "mode", "level", "bandwidth_mbps", "context_tokens")
# Run fields that get a median per cell (everything numeric that varies between repeats).
METRICS = (
    "ttft_s",
    "ttft_wall_s",
    "e2e_s",
    "output_tokens_per_s",
    "bytes",
    "bits_per_element",
    "ratio_vs_fp16",
    "ratio_vs_int8",
    "encode_s",
    "transfer_s",
    "decode_s",
    "inject_s",
    "load_s",
    "goodput_mbps",
    "loaded_tokens",
    "output_tokens",
)


class ResultsError(InputError):
    """A results document does not follow the schema."""


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


def new_document(command: str, environment: dict, config: dict) -> dict:
    return versioned(
        SCHEMA_NAME,
        SCHEMA_VERSION,
        {
            "created": "",
            "command": command,
            "environment": environment,
            "config": config,
            "runs": [],
            "medians": [],
            "quality": [],
            "missing": [],
        },
    )


def finish(doc: dict) -> dict:
    """Stamp the time, compute medians and validate; returns ``doc``."""
    from cachegen_lab.bench.environment import load_average

    doc["created"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    doc["environment"].setdefault("load_average", {})["end"] = load_average()
    doc["medians"] = medians(doc["runs"])
    validate(doc)
    return doc


def cell(row: dict) -> tuple:
    return tuple(row.get(k) for k in CELL)


def medians(runs: list[dict]) -> list[dict]:
    """One row per cell with the median of each metric over the runs that reported it."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault(cell(run), []).append(run)
    rows = []
    for key, members in groups.items():
        row = dict(zip(CELL, key))
        row["n"] = len(members)
        for metric in METRICS:
            values = [r[metric] for r in members if isinstance(r.get(metric), (int, float))]
            row[metric] = statistics.median(values) if values else None
        rows.append(row)
    return rows


def validate(doc: object) -> None:
    """Raise :class:`ResultsError` naming the first problem, if ``doc`` is not valid results."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema(), registry=rows.registry())
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ResultsError(f"results do not follow {SCHEMA_PATH.name} at {where}: {error.message}")
    for run in doc["runs"]:
        for metric in METRICS:
            value = run.get(metric)
            if isinstance(value, float) and not math.isfinite(value):
                raise ResultsError(f"run {cell(run)} has a non-finite {metric}")
    expected = {cell(r): r for r in medians(doc["runs"])}
    stated = {cell(r): r for r in doc["medians"]}
    if expected.keys() != stated.keys():
        raise ResultsError(
            "medians do not cover exactly the cells of the runs; regenerate the file"
        )
    for key, row in expected.items():
        if row["n"] != stated[key].get("n"):
            raise ResultsError(
                f"median of cell {key} counts {stated[key].get('n')} runs, the runs have {row['n']}"
            )


def save(doc: dict, path: str | os.PathLike) -> Path:
    """Validate and write atomically (temp file + rename), so readers never see half a file."""
    validate(doc)
    return write_atomic(path, (json.dumps(doc, indent=1) + "\n").encode())


def load(path: str | os.PathLike) -> dict:
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ResultsError(
            f"{path} does not exist; run `cachegen bench --output {path}` first"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path} is not readable JSON: {exc}") from None
    check_version(doc, SCHEMA_NAME, READ_VERSIONS, str(path))
    validate(doc)
    return doc


def lookup(doc: dict, **where) -> list[dict]:
    """Median rows whose fields equal ``where`` (e.g. ``kind="e2e", mode="int8"``)."""
    return [r for r in doc["medians"] if all(r.get(k) == v for k, v in where.items())]
