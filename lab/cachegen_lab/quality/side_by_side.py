"""Codecs side by side across models and domains: ``cachegen eval-table``.

Each input is one ``cachegen eval`` document (eval.json: one model, one dataset, the same
windows for every codec). The table has a row per model and dataset and a cell per codec
level: bits/element, perplexity change with its 95% interval, top-1 agreement. Below it, for
each model, how a ``--versus`` codec compares with each other codec: how many times more bits
it takes, on how many datasets the other codec's perplexity change is no larger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cachegen.errors import InputError
from cachegen_lab.quality import frontier

SCHEMA = "cachegen-eval-table"
VERSION = 1


@dataclass(frozen=True)
class Cell:
    """One codec level's result on one model and dataset."""

    bits: float
    ppl_pct: float
    ci95: tuple[float, float]
    top1: float

    def markdown(self) -> str:
        low, high = self.ci95
        return (
            f"{self.bits:.2f} b, {self.ppl_pct:+.2f}% ({low:+.2f} .. {high:+.2f}), "
            f"top-1 {100 * self.top1:.1f}%"
        )


def cells(documents: list[dict]) -> dict[tuple[str, str], dict[str, Cell]]:
    """(model, dataset) -> codec label -> its cell, from eval.json documents."""
    table: dict[tuple[str, str], dict[str, Cell]] = {}
    for doc in documents:
        for row in doc["rows"]:
            key = (row["model"], row["dataset"])
            interval = row.get("ppl_change_ci95") or [math.nan, math.nan]
            cell = Cell(
                row["bits_per_element"],
                row["ppl_change_pct"],
                tuple(interval),
                row["top1_agreement"],
            )
            label = frontier.label(row)
            if label in table.get(key, {}):
                raise InputError(f"{label} on {key[0]} {key[1]} is in two eval documents")
            table.setdefault(key, {})[label] = cell
    return table


def columns(table: dict[tuple[str, str], dict[str, Cell]]) -> list[str]:
    """Codec labels in the order the codecs first appear, a model's own levels in one column
    (``cachegen/11`` on one model and ``cachegen/9`` on another share ``cachegen``)."""
    seen: list[str] = []
    for row in table.values():
        for label in row:
            if codec_of(label) not in seen:
                seen.append(codec_of(label))
    return seen


def codec_of(label: str) -> str:
    return label.split("/")[0]


def markdown(table: dict[tuple[str, str], dict[str, Cell]]) -> str:
    names = columns(table)
    lines = [
        "| model | dataset | " + " | ".join(names) + " |",
        "| --- | --- | " + " | ".join("---" for _ in names) + " |",
    ]
    for (model, dataset), row in table.items():
        by_codec = {codec_of(label): (label, cell) for label, cell in row.items()}
        out = []
        for name in names:
            label, cell = by_codec.get(name, (None, None))
            out.append("-" if cell is None else f"{_level(label)}{cell.markdown()}")
        lines.append(f"| {model} | {dataset} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def _level(label: str) -> str:
    level = label.split("/")[1] if "/" in label else "0"
    return "" if level == "0" else f"L{level}: "


@dataclass(frozen=True)
class Versus:
    """How ``other`` compares with the reference codec on one model."""

    model: str
    other: str
    bits_ratio: float  # the reference's bits over the other's, geometric mean over datasets
    no_worse: int  # datasets where the other's perplexity change is no larger
    datasets: int

    def markdown(self) -> str:
        return (
            f"| {self.model} | {self.other} | {self.bits_ratio:.2f}x | "
            f"{self.no_worse} of {self.datasets} |"
        )


def versus(table: dict[tuple[str, str], dict[str, Cell]], reference: str) -> list[Versus]:
    """Each model's comparison of every other codec with ``reference`` (a codec name)."""
    found = []
    for model in dict.fromkeys(model for model, _ in table):
        rows = [row for (m, _), row in table.items() if m == model]
        found += [
            _versus_one(model, name, rows, reference)
            for name in columns(table)
            if name != reference
        ]
    return [v for v in found if v is not None]


def _versus_one(model: str, other: str, rows: list[dict], reference: str) -> Versus | None:
    pairs = []
    for row in rows:
        by_codec = {codec_of(label): cell for label, cell in row.items()}
        if reference in by_codec and other in by_codec:
            pairs.append((by_codec[reference], by_codec[other]))
    if not pairs:
        return None
    log_ratio = sum(math.log(ref.bits / mine.bits) for ref, mine in pairs) / len(pairs)
    no_worse = sum(mine.ppl_pct <= ref.ppl_pct for ref, mine in pairs)
    return Versus(model, other, math.exp(log_ratio), no_worse, len(pairs))


def versus_markdown(rows: list[Versus], reference: str) -> str:
    lines = [
        f"| model | codec | {reference}'s bits over the codec's | datasets where the codec's "
        f"perplexity change is no larger than {reference}'s |",
        "| --- | --- | ---: | ---: |",
    ]
    return "\n".join(lines + [row.markdown() for row in rows]) + "\n"
