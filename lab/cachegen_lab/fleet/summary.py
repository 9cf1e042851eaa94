"""The fleet's records, summaries, versioned document and markdown table.

A run is one configuration at one link rate (``bandwidth_mbps``; null: no rate limit, and
always null for a configuration without the connector). A record (times in seconds from the
run's first send): ``config``, ``bandwidth_mbps``, ``workload``, ``index``, ``key`` (user or
document), ``round``, ``routed`` (the server the router's policy names), ``server`` (the one
that answered, or the last one tried: another than ``routed`` after a failover), ``attempts``
(the earlier tries that failed over: their server and error), ``send_s``, ``ttft_s`` (first
send to first content; null when none came), ``end_s``, ``prompt_tokens``, ``output_tokens``,
``cached_tokens`` (vLLM's count of prompt tokens it did not prefill: its prefix cache plus the
connector's), ``report`` (the connector's report, null when the server sent none, as
LMCache's never does), ``error`` and ``answer``. The summary, per run: requests, errors,
failovers (requests with an earlier failed try), TTFT p50/p90/p99, requests/s and output
tokens/s over the wall time (first send to last end), requests per server, prompt and cached
tokens, answers equal to the recompute run's (when one ran), and for the connector: requests
with a report, hits (reports with ``loaded_tokens`` > 0), the hit rate (hits per request),
loaded tokens and bytes, and load errors (reports with ``load_error`` or ``error``: part of a
prefix recomputed). A run's ``store`` (null without the connector) is what its requests wrote
to the store (``cachegen_lab.fleet.census``): keys, entries and payload bytes, per kind and
per form (its name: ``tcq-22``, ``cachegen-11-packed``...), and how many of them do not read
back verified. The document holds the settings, every run (its setup, with LMCache's
``kv_transfer_config`` and ``lmcache_env`` for ``lmcache``; summary, stops, records and store
census) and the failure that ended the bench early (null when every configuration ran).
Versions 3 (without the store census), 4 and 5 (the census per the store's internal number for
a form, under ``levels``) are still read.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from cachegen.fileio import versioned
from cachegen_lab.bench.links import link_label

SCHEMA = "cachegen-fleet-bench"
VERSION = 6

_NUM = {"type": ["number", "null"]}
_INT = {"type": ["integer", "null"]}
_STR = {"type": ["string", "null"]}
ATTEMPT = {
    "type": "object",
    "required": ["server", "error"],
    "properties": {"server": {"type": "integer"}, "error": {"type": "string"}},
}
STOP = {
    "type": "object",
    "required": ["server", "at_s"],
    "properties": {"server": {"type": "integer"}, "at_s": {"type": "number"}},
}
STOP_SETTING = {
    "required": ["server", "after"],
    "properties": {"server": {"type": "integer"}, "after": {"type": "integer"}},
}
FAILURE = {
    "type": ["object", "null"],
    "required": ["config", "error"],
    "properties": {"config": {"type": "string"}, "error": {"type": "string"}},
}
SETTINGS_FIELDS = {
    "model": {"type": "string"},
    "workload": {"type": "string"},
    "workload_settings": {"type": "object"},
    "seed": {"type": "integer"},
    "requests": {"type": "integer"},
    "servers": {"type": "integer"},
    "router": {"type": "string"},
    "concurrency": {"type": "integer"},
    "max_tokens": {"type": "integer"},
    "api": {"type": "string"},
    "ignore_eos": {"type": "boolean"},
    "bandwidths_mbps": {"type": "array", "items": _NUM},
    "store": _STR,
    "slo_ms": {"type": "number"},
    "stop": {**STOP_SETTING, "type": ["object", "null"]},
    "kv_cache_gib": {"type": "integer"},
    "kv_cache_blocks": _INT,
}
SETUP_FIELDS = {
    "config": {"type": "string"},
    "mode": {"type": "string"},
    "prefix_caching": {"type": "boolean"},
    "connector": {"type": "boolean"},
    "connector_extra": {"type": "object"},
    "store": _STR,
    "tenant": _STR,
    "cache_salt": {"type": "string"},
}
LMCACHE_SETUP_FIELDS = {  # in the setup of an lmcache run only
    "kv_transfer_config": {"type": "object"},
    "lmcache_env": {"type": "object", "additionalProperties": {"type": "string"}},
}
RECORD_FIELDS = {
    "config": {"type": "string"},
    "bandwidth_mbps": _NUM,
    "workload": {"type": "string"},
    "index": {"type": "integer"},
    "key": {"type": "string"},
    "round": {"type": "integer"},
    "routed": {"type": "integer"},
    "server": {"type": "integer"},
    "attempts": {"type": "array", "items": ATTEMPT},
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
    "failovers": {"type": "integer"},
    "wall_s": {"type": "number"},
    "ttft_p50_s": _NUM,
    "ttft_p90_s": _NUM,
    "ttft_p99_s": _NUM,
    "requests_per_s": _NUM,
    "output_tokens": {"type": "integer"},
    "output_tokens_per_s": _NUM,
    "requests_per_server": {"type": "array", "items": {"type": "integer"}},
    "prompt_tokens": {"type": "integer"},
    "cached_tokens": {"type": "integer"},
    "answers_as_recompute": _INT,
    "reports": {"type": "integer"},
    "connector_hits": _INT,
    "connector_hit_rate": _NUM,
    "loaded_tokens": _INT,
    "loaded_bytes": _INT,
    "load_errors": _INT,
}


def _object(fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": sorted(fields), "properties": fields}


TALLY = _object({"entries": {"type": "integer"}, "payload_bytes": {"type": "integer"}})
TALLIES = {"type": "object", "additionalProperties": TALLY}
STORE_FIELDS = {
    "chunks": {"type": "integer"},  # distinct keys, as the store's stats call them
    "entries": {"type": "integer"},
    "payload_bytes": {"type": "integer"},
    "kinds": TALLIES,
    "forms": TALLIES,  # by form name ("unknown": a record that is not a bitstream)
    "unreadable": {"type": "integer"},
}


def _census(fields: dict[str, Any]) -> dict[str, Any]:
    """A run's store census with ``fields``, or null (no census taken)."""
    return {**_object(fields), "type": ["object", "null"]}


RUN_FIELDS = {
    "config": {"type": "string"},
    "bandwidth_mbps": _NUM,
    "setup": {**_object(SETUP_FIELDS), "properties": {**SETUP_FIELDS, **LMCACHE_SETUP_FIELDS}},
    "summary": _object(SUMMARY_FIELDS),
    "stops": {"type": "array", "items": STOP},
    "records": {"type": "array", "items": _object(RECORD_FIELDS)},
    "store": _census(STORE_FIELDS),
}
# version 3: the same without the runs' store census; version 5: the census tallied `levels`
# (keyed by the store's slot of a form) where this one tallies `forms`; version 4: as 5, its
# `chunks` called `keys`
READABLE = (3, 4, 5, VERSION)
OLD_NAMES = {5: {"forms": "levels"}, 4: {"forms": "levels", "chunks": "keys"}}


def _run_fields(version: int) -> dict[str, Any]:
    if version == 3:
        return {k: v for k, v in RUN_FIELDS.items() if k != "store"}
    if version in OLD_NAMES:
        names = OLD_NAMES[version]
        fields = {names.get(k, k): v for k, v in STORE_FIELDS.items()}
        return {**RUN_FIELDS, "store": _census(fields)}
    return RUN_FIELDS


def json_schema(version: int = VERSION) -> dict[str, Any]:
    """The JSON Schema of a fleet-bench document of ``version`` (one of ``READABLE``)."""
    run = _run_fields(version)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": SCHEMA,
        "type": "object",
        "required": ["schema", "version", "settings", "runs", "failure"],
        "properties": {
            "schema": {"const": SCHEMA},
            "version": {"const": version},
            "settings": _object(SETTINGS_FIELDS),
            "runs": {"type": "array", "items": _object(run)},
            "failure": FAILURE,
        },
    }


def record(
    run: tuple[str, float | None],
    workload: str,
    request,
    answer,
    start: float,
    *,
    routed: int,
    server: int,
    attempts: list[dict[str, Any]],
) -> dict:
    """The record of one request: ``run`` is its (configuration, link rate), ``answer`` a
    ``client.Answer`` (its ``sent`` the first try's), ``start`` the run's ``perf_counter``
    origin, ``routed`` the server the router's policy names, ``server`` the one that answered
    (another one after a failover), ``attempts`` the tries that failed over."""
    config, bandwidth_mbps = run
    return {
        "config": config,
        "bandwidth_mbps": bandwidth_mbps,
        "workload": workload,
        "index": request.index,
        "key": request.key,
        "round": request.round,
        "routed": routed,
        "server": server,
        "attempts": attempts,
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


def _connector_fields(records: list[dict], reports: list[dict]) -> dict[str, Any]:
    hits = sum(1 for rep in reports if (rep.get("loaded_tokens") or 0) > 0)
    return {
        "connector_hits": hits,
        "connector_hit_rate": hits / len(records) if records else None,
        "loaded_tokens": sum(rep.get("loaded_tokens") or 0 for rep in reports),
        "loaded_bytes": sum(rep.get("bytes") or 0 for rep in reports),
        "load_errors": sum(1 for rep in reports if rep.get("load_error") or rep.get("error")),
    }


NO_CONNECTOR = dict.fromkeys(
    ("connector_hits", "connector_hit_rate", "loaded_tokens", "loaded_bytes", "load_errors")
)


def summarize(records: list[dict], servers: int, *, connector: bool) -> dict[str, Any]:
    ok = [r for r in records if r["error"] is None]
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    wall = max((r["end_s"] for r in records), default=0.0) - min(
        (r["send_s"] for r in records), default=0.0
    )
    output_tokens = sum(r["output_tokens"] for r in ok)
    reports = [r["report"] for r in records if r["report"] is not None]
    per_server = [0] * servers
    for r in records:
        per_server[r["server"]] += 1
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "failovers": sum(1 for r in records if r["attempts"]),
        "wall_s": wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "requests_per_s": len(records) / wall if wall > 0 else None,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall if wall > 0 else None,
        "requests_per_server": per_server,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in ok),
        "answers_as_recompute": None,
        "reports": len(reports),
        **(_connector_fields(records, reports) if connector else NO_CONNECTOR),
    }


def compare_answers(runs: list[dict[str, Any]], reference: str) -> None:
    """Set every run's ``answers_as_recompute``: its requests whose answer equals the answer
    of the same request in the run of configuration ``reference`` (when there is one)."""
    ref = next((r for r in runs if r["config"] == reference), None)
    if ref is None:
        return
    answers = {r["index"]: r["answer"] for r in ref["records"] if r["error"] is None}
    for run in runs:
        run["summary"]["answers_as_recompute"] = sum(
            1
            for r in run["records"]
            if r["error"] is None and answers.get(r["index"]) == r["answer"]
        )


def document(
    settings: dict[str, Any], runs: list[dict[str, Any]], failure: dict[str, str] | None = None
) -> dict[str, Any]:
    """The versioned document: ``failure`` (``{"config", "error"}``) names the configuration
    that ended the bench early, the runs being those done before it."""
    return versioned(SCHEMA, VERSION, {"settings": settings, "runs": runs, "failure": failure})


def validate(doc: object) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` is a fleet-bench document of one of
    the ``READABLE`` versions (this one unless it says another)."""
    import jsonschema

    version = doc.get("version") if isinstance(doc, dict) else None
    schema = json_schema(version if version in READABLE else VERSION)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _stored(census: dict[str, Any] | None) -> str:
    if census is None:
        return "- | - | -"
    return f"{census['entries']} | {census['payload_bytes']} | {census['unreadable']}"


def markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    lines = [
        f"{s['model']}, {s['workload']} ({s['requests']} requests, seed {s['seed']}), "
        f"{s['servers']} servers, router {s['router']}, concurrency {s['concurrency']}, "
        f"{s['max_tokens']} greedy output tokens",
        "",
        "| config | link (Mbit/s) | requests | errors | failovers | as recompute "
        "| TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | requests/s | output tokens/s "
        "| per server | prompt tokens | cached tokens | connector hit rate | loaded tokens "
        "| loaded bytes | load errors | stored entries | stored bytes | unreadable |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in doc["runs"]:
        m = c["summary"]
        hit_rate = m["connector_hit_rate"]
        link = "-" if c["setup"]["connector"] is False else link_label(c["bandwidth_mbps"])
        lines.append(
            f"| {c['config']} | {link} | {m['requests']} | {m['errors']} | {m['failovers']} "
            f"| {_opt(m['answers_as_recompute'])} | {_ms(m['ttft_p50_s'])} "
            f"| {_ms(m['ttft_p90_s'])} | {_ms(m['ttft_p99_s'])} "
            f"| {_num(m['requests_per_s'], 2)} | {_num(m['output_tokens_per_s'], 1)} "
            f"| {' / '.join(map(str, m['requests_per_server']))} | {m['prompt_tokens']} "
            f"| {m['cached_tokens']} "
            f"| {'-' if hit_rate is None else f'{hit_rate:.0%}'} "
            f"| {_opt(m['loaded_tokens'])} | {_opt(m['loaded_bytes'])} "
            f"| {_opt(m['load_errors'])} | {_stored(c.get('store'))} |"
        )
    failure = doc["failure"]
    if failure is not None:
        first_line = (failure["error"].splitlines() or [""])[0]
        lines += ["", f"Ended early: {failure['config']} failed: {first_line}"]
    return "\n".join(lines)
