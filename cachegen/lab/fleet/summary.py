"""The fleet's records, summaries, versioned document and markdown table.

A record (times in seconds from the configuration's first send): ``config``, ``workload``,
``index``, ``key`` (user or document), ``round``, ``server``, ``send_s``, ``ttft_s`` (send to
first content; null when none came), ``end_s``, ``prompt_tokens``, ``output_tokens``,
``cached_tokens`` (vLLM's count of prompt tokens it did not prefill: its prefix cache plus the
connector's), ``report`` (the connector's report, null when the server sent none), ``error``
and ``answer``. The summary, per configuration: requests, errors, TTFT p50/p90/p99, requests/s
and output tokens/s over the wall time (first send to last end), requests per server, and for
the connector: requests with a report, hits (reports with ``loaded_tokens`` > 0), the hit rate
(hits per request), loaded tokens and loaded bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from cachegen.fileio import versioned

SCHEMA = "cachegen-fleet-bench"
VERSION = 1

_NUM = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}
RECORD_FIELDS = {
    "config": {"type": "string"},
    "workload": {"type": "string"},
    "index": {"type": "integer"},
    "key": {"type": "string"},
    "round": {"type": "integer"},
    "server": {"type": "integer"},
    "send_s": {"type": "number"},
    "ttft_s": _NUM,
    "end_s": {"type": "number"},
    "prompt_tokens": _INT,
    "output_tokens": {"type": "integer"},
    "cached_tokens": _INT,
    "report": {"type": ["object", "null"]},
    "error": {"type": ["string", "null"]},
    "answer": {"type": "string"},
}
SUMMARY_FIELDS = {
    "requests": {"type": "integer"},
    "errors": {"type": "integer"},
    "wall_s": {"type": "number"},
    "ttft_p50_s": _NUM,
    "ttft_p90_s": _NUM,
    "ttft_p99_s": _NUM,
    "requests_per_s": _NUM,
    "output_tokens": {"type": "integer"},
    "output_tokens_per_s": _NUM,
    "requests_per_server": {"type": "array", "items": {"type": "integer"}},
    "reports": {"type": "integer"},
    "connector_hits": _INT,
    "connector_hit_rate": _NUM,
    "loaded_tokens": _INT,
    "loaded_bytes": _INT,
}


def _object(fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": sorted(fields), "properties": fields}


JSON_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA,
    "type": "object",
    "required": ["schema", "version", "settings", "configs"],
    "properties": {
        "schema": {"const": SCHEMA},
        "version": {"const": VERSION},
        "settings": {"type": "object"},
        "configs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["config", "setup", "summary", "records"],
                "properties": {
                    "config": {"type": "string"},
                    "setup": {"type": "object"},
                    "summary": _object(SUMMARY_FIELDS),
                    "records": {"type": "array", "items": _object(RECORD_FIELDS)},
                },
            },
        },
    },
}


def record(config: str, workload: str, request, server: int, answer, start: float) -> dict:
    """The record of one request (``answer``: a ``client.Answer``; ``start``: the run's
    ``perf_counter`` origin)."""
    return {
        "config": config,
        "workload": workload,
        "index": request.index,
        "key": request.key,
        "round": request.round,
        "server": server,
        "send_s": answer.sent - start,
        "ttft_s": None if answer.first is None else answer.first - answer.sent,
        "end_s": answer.end - start,
        "prompt_tokens": answer.prompt_tokens,
        "output_tokens": answer.output_tokens,
        "cached_tokens": answer.cached_tokens,
        "report": answer.report,
        "error": answer.error,
        "answer": answer.text,
    }


def percentile(values: Sequence[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=100, method="inclusive")[q - 1])


def summarize(records: list[dict], servers: int, *, connector: bool) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    wall = max((r["end_s"] for r in records), default=0.0) - min(
        (r["send_s"] for r in records), default=0.0
    )
    output_tokens = sum(r["output_tokens"] for r in ok)
    reports = [r["report"] for r in records if r["report"] is not None]
    hits = sum(1 for rep in reports if (rep.get("loaded_tokens") or 0) > 0)
    per_server = [0] * servers
    for r in records:
        per_server[r["server"]] += 1
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "requests_per_s": len(records) / wall if wall > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall if wall > 0 else None,
        "requests_per_server": per_server,
        "reports": len(reports),
        "connector_hits": hits if connector else None,
        "connector_hit_rate": hits / len(records) if connector and records else None,
        "loaded_tokens": sum(rep.get("loaded_tokens") or 0 for rep in reports)
        if connector
        else None,
        "loaded_bytes": sum(rep.get("bytes") or 0 for rep in reports) if connector else None,
    }


def document(settings: dict[str, Any], configs: list[dict[str, Any]]) -> dict[str, Any]:
    return versioned(SCHEMA, VERSION, {"settings": settings, "configs": configs})


def validate(doc: object) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a fleet-bench document of this
    version."""
    import jsonschema

    jsonschema.validate(doc, JSON_SCHEMA, cls=jsonschema.Draft202012Validator)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    lines = [
        f"{s['model']}, {s['workload']} ({s['requests']} requests, seed {s['seed']}), "
        f"{s['servers']} servers, router {s['router']}, concurrency {s['concurrency']}, "
        f"{s['max_tokens']} greedy output tokens",
        "",
        "| config | requests | errors | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) "
        "| requests/s | output tokens/s | per server | connector hit rate | loaded tokens "
        "| loaded bytes |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for c in doc["configs"]:
        m = c["summary"]
        hit_rate = m["connector_hit_rate"]
        lines.append(
            f"| {c['config']} | {m['requests']} | {m['errors']} | {_ms(m['ttft_p50_s'])} "
            f"| {_ms(m['ttft_p90_s'])} | {_ms(m['ttft_p99_s'])} "
            f"| {_num(m['requests_per_s'], 2)} | {_num(m['output_tokens_per_s'], 1)} "
            f"| {' / '.join(map(str, m['requests_per_server']))} "
            f"| {'-' if hit_rate is None else f'{hit_rate:.0%}'} "
            f"| {'-' if m['loaded_tokens'] is None else m['loaded_tokens']} "
            f"| {'-' if m['loaded_bytes'] is None else m['loaded_bytes']} |"
        )
    return "\n".join(lines)
