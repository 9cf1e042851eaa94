"""Writing evaluation results: terminal table, JSON document, Markdown table and plot.

``cachegen eval --out`` and ``cachegen sweep`` write one kind of document (eval.json,
sweep.json): ``cachegen-quality-results``, whose rows are ``quality`` rows of the lab's row
schema (``cachegen_lab.rows``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from cachegen.errors import CacheGenError, InputError
from cachegen.fileio import check_version, versioned, write_atomic
from cachegen_lab import rows as row_schema
from cachegen_lab.quality import frontier

SCHEMA = "cachegen-quality-results"
VERSION = 1


def terminal_table(rows: list[dict]) -> str:
    cols = [
        ("codec/level", lambda r: frontier.label(r) + (" *" if r.get("pareto") else "")),
        ("bits/elem", lambda r: f"{r['bits_per_element']:.3f}"),
        ("ppl %", lambda r: f"{r['ppl_change_pct']:+.2f}"),
        ("top-1", lambda r: f"{100 * r['top1_agreement']:.1f}%"),
        ("KL", lambda r: f"{r['kl']:.4f}"),
        ("exact", lambda r: "-" if r.get("exact_match") is None else f"{r['exact_match']:.2f}"),
        ("ROUGE-L", lambda r: "-" if r.get("rougeL") is None else f"{r['rougeL']:.3f}"),
        ("BLEU", lambda r: "-" if r.get("bleu") is None else f"{r['bleu']:.1f}"),
        ("windows", lambda r: str(r["windows"])),
    ]
    if any("retrieval_accuracy" in r for r in rows):
        cols.append(
            (
                "retrieval orig->dec (95% CI of dec)",
                lambda r: (
                    f"{100 * r['retrieval_accuracy_original']:.1f}%->"
                    f"{100 * r['retrieval_accuracy']:.1f}%"
                    + _interval_pct(r.get("retrieval_accuracy_ci95"))
                    if "retrieval_accuracy" in r
                    else "-"
                ),
            )
        )
    cells = [[fmt(r) for _, fmt in cols] for r in rows]
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, (name, _) in enumerate(cols)]
    lines = ["  ".join(name.ljust(w) for (name, _), w in zip(cols, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.append("* on the Pareto frontier of bits/element vs perplexity change")
    return "\n".join(lines)


def write_json(path: Path, document, indent: int = 2) -> None:
    """Write ``document`` as JSON atomically (temporary file renamed into place)."""
    write_atomic(path, (json.dumps(document, indent=indent) + "\n").encode())


def finish_run(
    compute: Callable[[], dict], json_path: Path | None, table: Callable[[dict], str]
) -> int:
    """A lab command's ending: the document ``compute`` makes, written to ``json_path`` (if
    given) and shown as ``table``; exit status 0, or 2 with the reason on stderr when it
    raises a :class:`CacheGenError` (then nothing is written)."""
    try:
        document = compute()
    except CacheGenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if json_path:
        write_json(json_path, document, indent=1)
    print(table(document))
    return 0


def new_document(body: dict) -> dict:
    """An eval.json or sweep.json document holding ``body`` (command, model, data, rows...)."""
    return versioned(SCHEMA, VERSION, body)


def read_document(path: Path) -> dict:
    """A results document written by :func:`write_outputs`."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read results {path}: {exc}") from exc
    check_version(doc, SCHEMA, (VERSION,), str(path))
    if not isinstance(doc.get("rows"), list) or "model" not in doc:
        raise InputError(f"{path} has no rows or no model: it is not a whole results file")
    row_schema.validate(doc["rows"], "quality", str(path))
    return doc


def update_rows(document: dict, updates: list[dict], drop: list[str]) -> None:
    """Replace (or add) ``document``'s rows with those of ``updates``, results measured on the
    same data and windows, and remove the rows labelled in ``drop``. The commands behind the
    rows are kept in ``document["updates"]``."""

    def key(row: dict) -> str:
        return f"{row['codec']}/{row['level']}"

    rows = list(document["rows"])
    for update in updates:
        same = all(
            update.get(f) == document.get(f)
            for f in ("model", "data", "windows", "gen_tokens", "gen_windows")
        )
        if not same:
            raise InputError(
                f"cannot merge `{update.get('command')}`: it was measured on other data, "
                f"windows or generation settings than the sweep ({document.get('command')})"
            )
        index = {key(row): i for i, row in enumerate(rows)}
        for row in update["rows"]:
            if key(row) in index:
                rows[index[key(row)]] = row
            else:
                rows.append(row)
    dropped = set(drop)
    unknown = sorted(dropped - {key(row) for row in rows})
    if unknown:
        raise InputError(f"--drop: the sweep has no row {', '.join(unknown)}")
    document["rows"] = [row for row in rows if key(row) not in dropped]
    history = document.setdefault("updates", [])
    history += [{"command": u.get("command"), "rows": [key(r) for r in u["rows"]]} for u in updates]
    if drop:
        history.append({"dropped": list(drop)})


def write_outputs(out: Path, stem: str, document: dict, title: str) -> list[Path]:
    """``<stem>.json``, ``<stem>.md`` (table) and ``<stem>.png`` (rate-distortion plot) in
    ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = document["rows"]
    json_path, md_path, png_path = out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.png"
    row_schema.validate(rows, "quality", str(json_path))
    write_json(json_path, document)
    md_path.write_text(frontier.markdown_table(rows))
    frontier.plot(rows, png_path, title)
    return [json_path, md_path, png_path]


def _interval_pct(interval: list[float] | None) -> str:
    return "" if interval is None else f" ({100 * interval[0]:.0f}..{100 * interval[1]:.0f}%)"
