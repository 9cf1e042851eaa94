"""Rate-distortion bookkeeping: Pareto frontiers, dominance, tables and plots of result rows.

A row is what :func:`cachegen_lab.quality.evaluate.evaluate` returns. Rate is
``bits_per_element`` (everything the bitstream holds, counted); distortion is one of the
quality metrics, each with the direction that is better.
"""

from __future__ import annotations

import math
from pathlib import Path

# Distortion of a row, smaller is better. Perplexity counts its change in either direction:
# a decoded KV that makes the text *more* likely is still a different model.
METRICS = {
    "ppl_change_pct": lambda r: abs(r["ppl_change_pct"]),
    "top1_agreement": lambda r: 1.0 - r["top1_agreement"],
    "kl": lambda r: r["kl"],
}
LABELS = {
    "ppl_change_pct": "|perplexity change| (%)",
    "top1_agreement": "top-1 disagreement (1 - agreement)",
    "kl": "KL (nats/token)",
}


def distortion(row: dict, metric: str) -> float:
    return METRICS[metric](row)


def dominates(a: dict, b: dict, metric: str = "ppl_change_pct") -> bool:
    """``a`` is no worse than ``b`` in rate and distortion and strictly better in one."""
    da, db = distortion(a, metric), distortion(b, metric)
    no_worse = a["bits_per_element"] <= b["bits_per_element"] and da <= db
    return no_worse and (a["bits_per_element"] < b["bits_per_element"] or da < db)


def pareto(rows: list[dict], metric: str = "ppl_change_pct") -> list[int]:
    """Indices of the rows on the Pareto frontier (sorted by rate)."""
    keep = [i for i, r in enumerate(rows) if not any(dominates(o, r, metric) for o in rows)]
    return sorted(keep, key=lambda i: rows[i]["bits_per_element"])


def label(row: dict) -> str:
    return f"{row['codec']}/{row['level']}"


def annotate(rows: list[dict]) -> None:
    """Add ``pareto`` (on the ppl frontier) and ``dominated_by`` (frontier labels) to each row."""
    front = set(pareto(rows))
    for i, row in enumerate(rows):
        row["pareto"] = i in front
        row["dominated_by"] = [label(rows[j]) for j in sorted(front) if dominates(rows[j], row)]


def _fmt(value, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    """A Markdown table of rows sorted by rate, frontier points in bold."""
    has_retrieval = any("retrieval_accuracy" in r for r in rows)
    head = [
        "codec/level",
        "bits/elem",
        "ratio vs fp16",
        "ppl change %",
        "95% CI",
        "top-1 agree",
        "KL",
        "exact",
        "ROUGE-L",
        "BLEU",
    ]
    if has_retrieval:
        head += ["retrieval (orig → dec)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(rows, key=lambda r: r["bits_per_element"]):
        name = label(row)
        if row.get("pareto"):
            name = f"**{name}**"
        ci = row.get("ppl_change_ci95")
        cells = [
            name,
            _fmt(row["bits_per_element"], 2),
            _fmt(row.get("ratio_vs_fp16"), 1),
            _fmt(row["ppl_change_pct"], 2),
            f"{ci[0]:.2f} .. {ci[1]:.2f}" if ci else "-",
            _fmt(100 * row["top1_agreement"], 1) + "%",
            _fmt(row["kl"], 4),
            _fmt(row.get("exact_match"), 2),
            _fmt(row.get("rougeL"), 3),
            _fmt(row.get("bleu"), 1),
        ]
        if has_retrieval:
            if "retrieval_accuracy" in row:
                original, decoded = row["retrieval_accuracy_original"], row["retrieval_accuracy"]
                cells.append(f"{100 * original:.1f}% → {100 * decoded:.1f}%")
            else:
                cells.append("-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path, title: str) -> Path:
    """PNG with one panel per metric: every row as a point, the Pareto frontier as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(6 * len(METRICS), 5))
    families = sorted({r["codec"] for r in rows})
    colors = {name: plt.cm.tab10(i % 10) for i, name in enumerate(families)}
    for ax, metric in zip(axes, METRICS):
        for row in rows:
            y = distortion(row, metric)
            ax.scatter(row["bits_per_element"], y, color=colors[row["codec"]], s=22, zorder=3)
            ax.annotate(
                str(row["level"]),
                (row["bits_per_element"], y),
                fontsize=6,
                xytext=(3, 3),
                textcoords="offset points",
            )
        front = [rows[i] for i in pareto(rows, metric)]
        ax.plot(
            [r["bits_per_element"] for r in front],
            [distortion(r, metric) for r in front],
            color="black",
            linewidth=1,
            drawstyle="steps-post",
            label="Pareto frontier",
            zorder=2,
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits per element (all overhead counted)")
        ax.set_ylabel(LABELS[metric])
        ax.set_yscale(
            "symlog", linthresh={"ppl_change_pct": 0.1, "top1_agreement": 1e-3, "kl": 1e-4}[metric]
        )
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
    for name in families:
        axes[0].scatter([], [], color=colors[name], label=name)
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
