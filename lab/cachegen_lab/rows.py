"""Measurement rows: one dataclass family, one JSON Schema (``bench/rows.schema.json``).

    LoadRow        a context's KV loaded over a link: sizes, transfer_s, decode_s, load_s
      RequestRow   one request through vLLM with the connector (``from_measurement``)
        TTFTRow    medians over repeats of one request (``cachegen ttft table``)
        Run        one results.json measurement (the sweep's ``e2e`` and ``stream`` parts)
      StreamRow    one load through a shaped link (``cachegen stream-bench``)

Quality rows (``cachegen eval``/``sweep``) and timeline rows are dicts built by their
modules; the schema covers them too. Field names and their meaning are defined once, in the
schema's ``fields`` (intervals and rates: docs/benchmarks.md, "Vocabulary").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from cachegen.errors import InputError
from cachegen.modes import RECOMPUTE

if TYPE_CHECKING:
    from cachegen_lab.bench.engine import Measurement

# Next to results.schema.json, which refers to it, so that both ship as cachegen_lab.bench's
# package data.
SCHEMA_PATH = Path(__file__).parent / "bench" / "rows.schema.json"
# What a row is about comes first in its JSON (then the measurements, in field order).
LEADING = ("kind", "model", "mode", "codec", "level", "bandwidth_mbps", "context_tokens", "repeat")
# What a loader measures of one load (its LoadStats, or the connector's report of it).
LOAD_MEASURES = ("bytes", "levels", "transfer_s", "decode_s", "load_s", "goodput_mbps")
# What a request row takes from the engine's Measurement of the request, by the same names.
REQUEST_MEASURES = (
    "mode",
    "level",
    "bandwidth_mbps",
    "slo_ms",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "ttft_s",
    "ttft_wall_s",
    "e2e_s",
    "output_tokens_per_s",
)


@dataclass(kw_only=True)
class LoadRow:
    """A context's KV loaded over a link, and what it cost."""

    model: str
    bandwidth_mbps: float | None = None
    context_tokens: int | None = None
    loaded_tokens: int | None = None
    bytes: int | None = None
    levels: list | None = None  # per chunk: the name of the form it was loaded in
    transfer_s: float | None = None
    decode_s: float | None = None
    load_s: float | None = None
    goodput_mbps: float | None = None

    def to_dict(self) -> dict:
        row = asdict(self)
        return {**{k: row[k] for k in LEADING if k in row}, **row}

    @staticmethod
    def measures(report: dict) -> dict:
        """The fields of ``LOAD_MEASURES`` from a loader's report (None where it has none):
        ``levels`` are the report's ``forms``, the name of the form each chunk was loaded in
        (``LoadStats.forms``, the connector's report)."""
        named = {**report, "levels": report.get("forms")}
        return {k: named.get(k) for k in LOAD_MEASURES}


@dataclass(kw_only=True)
class RequestRow(LoadRow):
    """One request through vLLM with the connector."""

    mode: str
    level: int | None = None
    slo_ms: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    ttft_wall_s: float | None = None
    e2e_s: float | None = None
    output_tokens_per_s: float | None = None
    inject_s: float | None = None
    load_error: str | None = None

    @classmethod
    def from_measurement(cls, m: Measurement, model: str) -> RequestRow:
        """The row of a ``ConnectorEngine`` measurement: the sweep's e2e runs and the TTFT
        tables both come from here."""
        report = m.connector
        return cls(
            model=model,
            **{k: getattr(m, k) for k in REQUEST_MEASURES},
            loaded_tokens=report.get("loaded_tokens", 0 if m.mode == RECOMPUTE else None),
            **cls.measures(report),
            inject_s=report.get("inject_s"),
            # "error": the request's options were refused, so nothing was loaded either
            load_error=report.get("load_error") or report.get("error"),
        )


@dataclass(kw_only=True)
class TTFTRow(RequestRow):
    """Medians of ``ttft_s``, ``ttft_wall_s``, ``e2e_s`` and ``output_tokens_per_s`` over
    ``repeats`` runs of one request; the other fields are the last run's."""

    shaper: str | None = None
    repeats: int
    ttft_runs_s: list[float]
    output_token_ids: list[int] | None = None


@dataclass(kw_only=True)
class Run(RequestRow):
    """One results.json measurement: an ``e2e`` request or a ``stream`` load."""

    kind: str
    repeat: int
    bits_per_element: float | None = None
    ratio_vs_fp16: float | None = None
    ratio_vs_int8: float | None = None
    encode_s: float | None = None

    @classmethod
    def of(cls, row: LoadRow, **values) -> Run:
        """A run with ``row``'s fields that runs have, and ``values``."""
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in asdict(row).items() if k in names}, **values})


@dataclass(kw_only=True)
class StreamRow(LoadRow):
    """One load of stored chunks through a shaped link, fetching and decoding pipelined."""

    codec: str
    level: int | None = None  # of every chunk; None when the adaptive controller chose
    shaper: str | None = None
    trace: str | None = None
    rtt_ms: float | None = None
    rtt_emulation: str | None = None
    netns: str | None = None
    qdisc: str | None = None
    n_chunks: int
    n_loaded: int
    recompute_from: int | None = None
    recompute_tokens: int = 0
    consume_s: float
    wait_bytes_s: float
    wait_decoder_s: float
    goodput_error: float | None = None
    pipeline_ratio: float | None = None
    ttft_model_s: float | None = None
    mean_level: float | None = None
    decisions: list[dict] = field(default_factory=list)
    loadavg_1min: list[float] | None = None
    transfer_alone_s: float | None = None
    goodput_alone_mbps: float | None = None
    decode_alone_s: float | None = None
    pipeline_ratio_vs_alone: float | None = None


# ---- the schema -------------------------------------------------------------------------


@lru_cache(maxsize=1)
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text())


@lru_cache(maxsize=1)
def registry():
    """A ``referencing`` registry holding the row schema, for schemas that refer to it."""
    from referencing import Registry, Resource

    return Registry().with_resource(schema()["$id"], Resource.from_contents(schema()))


def validate(rows: list[dict], kind: str, where: str) -> None:
    """Raise ``InputError`` naming ``where`` and the row when one of ``rows`` is not a row
    of ``kind`` (a definition of the row schema: run, ttft, timeline, stream, quality, ...)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(
        {"$ref": f"{schema()['$id']}#/$defs/{kind}"}, registry=registry()
    )
    for i, row in enumerate(rows):
        error = jsonschema.exceptions.best_match(validator.iter_errors(row))
        if error is not None:
            at = "/".join(str(p) for p in error.absolute_path) or "(row)"
            raise InputError(
                f"{where}: row {i} is not a {kind} row of {SCHEMA_PATH.name} at {at}: "
                f"{error.message}"
            )
