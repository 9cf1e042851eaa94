"""PNG figures from results.json (``cachegen plot``; the stored-forms documents' figures are
``document_plots``'s).

Every figure is drawn from the medians (error bars span the repeats' min..max), names its
units, and says so in the panel when a mode was asked for but not measured, instead of
leaving it out silently. Lines and points have one colour per mode, the same in every figure
(``mode_colours``); the adaptive modes are drawn bold with square markers.
"""

from __future__ import annotations

from pathlib import Path

from cachegen.modes import ADAPTIVE, ADAPTIVE_FASTEST, RECOMPUTE, Mode
from cachegen_lab.bench.links import link_order
from cachegen_lab.bench.plot_kit import footnote, link_x, log_axes, panels, runs_spread, save
from cachegen_lab.bench.results import lookup

FIGURES = (
    "ttft_by_mode",
    "ttft_vs_bandwidth",
    "throughput",
    "compression_ratio",
    "transfer_vs_bandwidth",
    "decode_time",
    "quality_vs_size",
)


def plot_all(doc: dict, out_dir: str | Path) -> list[Path]:
    """Write every figure into ``out_dir``; returns the paths in ``FIGURES`` order."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in FIGURES:
        paths.append(save(globals()[f"_{name}"](doc), out / f"{name}.png"))
    return paths


# ---- helpers -----------------------------------------------------------------------------


def _label(row: dict) -> str:
    return Mode(row["mode"], row["level"]).label


def _order(doc: dict) -> list[str]:
    """Mode labels in the order the sweep was configured with."""
    return list(doc["config"]["modes"])


def mode_colours(doc: dict) -> dict[str, tuple]:
    """One colour per mode label of the sweep, in its configured order, for every figure
    (recompute, drawn dashed grey, has none)."""
    import matplotlib

    grey = 7  # tab10's grey is recompute's
    tab10 = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != grey]
    palette = [*tab10, *matplotlib.colormaps["Dark2"].colors]
    labels = [label for label in _order(doc) if label != RECOMPUTE]
    return {label: palette[i % len(palette)] for i, label in enumerate(labels)}


def _line_style(label: str) -> dict:
    """The adaptive modes bold with square markers, the fixed ones plain with round ones."""
    if Mode.parse(label).mode in (ADAPTIVE, ADAPTIVE_FASTEST):
        return {"marker": "s", "linewidth": 2.4}
    return {"marker": "o"}


def _spread(doc: dict, row: dict, metric: str) -> tuple[float, float]:
    """(median - min, max - median) of ``metric`` over the runs of ``row``'s cell."""
    keys = ("kind", "model", "mode", "level", "bandwidth_mbps", "context_tokens")
    values = [
        r[metric]
        for r in doc["runs"]
        if all(r.get(k) == row.get(k) for k in keys) and isinstance(r.get(metric), (int, float))
    ]
    if row.get(metric) is None:
        return 0.0, 0.0
    return runs_spread(row[metric], values)


def _modes_note(doc: dict, contexts: bool = True) -> str:
    """What the figures' mode labels leave unsaid: the modes measured at the largest context
    only (for a figure of every context) or at some links only, and adaptive-fastest's quality
    bound per model."""
    cfg, notes = doc["config"], []
    if contexts and cfg.get("largest_context_modes"):
        notes.append(f"largest context only: {', '.join(cfg['largest_context_modes'])}.")
    for label, links in (cfg.get("mode_bandwidth_mbps") or {}).items():
        notes.append(f"{label} at {', '.join(f'{b:g}' for b in links)} Mbit/s only.")
    bounds = cfg.get("max_loss_pct") or {}
    if ADAPTIVE_FASTEST in _order(doc) and bounds:
        each = ", ".join(f"{model} {bound:g}%" for model, bound in bounds.items())
        notes.append(
            "adaptive-fastest: per chunk the fastest form of the connector's default save ladder "
            f"within a perplexity change of {each}."
        )
    return " ".join(notes)


def _missing_note(doc: dict, kind: str, model: str | None = None) -> str:
    rows = [
        m for m in doc["missing"] if m["kind"] == kind and (model is None or m["model"] == model)
    ]
    if not rows:
        return ""
    labels = sorted({Mode(m["mode"], m["level"]).label for m in rows})
    return "not measured: " + ", ".join(labels)


def _empty(ax, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        ha="center",
        va="center",
        transform=ax.transAxes,
        wrap=True,
        fontsize=10,
        color="0.35",
    )
    ax.set_xticks([])
    ax.set_yticks([])


def _models(doc: dict) -> list[str]:
    return list(doc["config"]["models"])


NOTHING = {  # what a model's panel says when it has no rows of a kind
    "e2e": "no end-to-end runs",
    "stream": "no codec measurements",
    "quality": "no quality measurements",
}


def _model_panels(doc: dict, title: str, kind: str, *, largest_context: bool = False):
    """A figure of one panel per model, and (ax, model, rows, mode labels) for each model with
    rows of ``kind`` (only its largest context's, if asked); the panel of a model without
    any says so, and what was not measured."""
    models = _models(doc)
    fig, axes = panels(len(models), title)
    found = []
    for ax, model in zip(axes, models):
        if kind == "quality":
            rows = [q for q in doc["quality"] if q["model"] == model]
        else:
            rows = lookup(doc, kind=kind, model=model)
        if rows and largest_context:
            context = max(r["context_tokens"] for r in rows)
            rows = [r for r in rows if r["context_tokens"] == context]
        if not rows:
            _empty(ax, f"{model}: {NOTHING[kind]}\n{_missing_note(doc, kind, model)}")
            continue
        labels = [m for m in _order(doc) if any(_label(r) == m for r in rows)]
        found.append((ax, model, rows, labels))
    return fig, found


def _bars(
    ax,
    groups: list[str],
    series: dict[str, list[tuple[float | None, tuple[float, float]]]],
    ylabel: str,
) -> None:
    """Grouped bars: one group per entry of ``groups``, one bar per series."""
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / max(len(series), 1)
    for i, (name, points) in enumerate(series.items()):
        heights = [p[0] if p[0] is not None else 0.0 for p in points]
        err = np.array([p[1] for p in points]).T if points else None
        bars = ax.bar(
            x + (i - (len(series) - 1) / 2) * width, heights, width, label=name, yerr=err, capsize=2
        )
        for bar, point in zip(bars, points):
            if point[0] is None:
                bar.set_visible(False)
    ax.set_xticks(x, groups, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)


# ---- figures -----------------------------------------------------------------------------


def _ttft_by_mode(doc: dict):
    fig, model_panels = _model_panels(
        doc, "Time to first token by mode (vLLM, lower is better)", "e2e", largest_context=True
    )
    for ax, model, rows, labels in model_panels:
        context = rows[0]["context_tokens"]
        # One bar per link rate; recompute (no link) repeats its one value in each.
        bandwidths = sorted(
            {r["bandwidth_mbps"] for r in rows if r["bandwidth_mbps"] is not None}
        ) or [None]
        series: dict[str, list] = {}
        for bw in bandwidths:
            points = []
            for label in labels:
                match = [
                    r for r in rows if _label(r) == label and r["bandwidth_mbps"] in (bw, None)
                ]
                points.append(
                    (match[0]["ttft_s"], _spread(doc, match[0], "ttft_s"))
                    if match
                    else (None, (0, 0))
                )
            series[f"{bw:g} Mbit/s" if bw is not None else "no KV link"] = points
        _bars(ax, labels, series, "TTFT (s)")
        ax.set_title(f"{model}, {context}-token context")
        ax.legend(title="KV link", fontsize=8)
    footnote(
        fig,
        "recompute moves no KV: its bar is the same at every bandwidth. "
        + _modes_note(doc, contexts=False)
        + " "
        + _missing_note(doc, "e2e"),
    )
    return fig


def _lines_vs_bandwidth(
    doc: dict, kind: str, metric: str, ylabel: str, title: str, flat_modes: tuple[str, ...]
):
    models = _models(doc)
    cells = [
        (m, c)
        for m in models
        for c in sorted({r["context_tokens"] for r in lookup(doc, kind=kind, model=m)})
    ]
    fig, axes = panels(len(cells), title)
    if not cells:
        _empty(axes[0], f"no {kind} runs\n{_missing_note(doc, kind)}")
        return fig
    colours = mode_colours(doc)
    # Stream runs also cover rates above the end-to-end grid and the unlimited link (None).
    links = doc["config"]["bandwidth_mbps"]
    if kind == "stream":
        links = doc["config"].get("stream_bandwidth_mbps") or links
    for ax, (model, context) in zip(axes, cells):
        rows = lookup(doc, kind=kind, model=model, context_tokens=context)
        values = [r[metric] for r in rows if r.get(metric)]
        for label in _order(doc):
            mine = sorted(
                (r for r in rows if _label(r) == label and r.get(metric) is not None),
                key=lambda r: link_order(r["bandwidth_mbps"]),
            )
            if not mine:
                continue
            if mine[0]["mode"] in flat_modes or (
                kind == "e2e" and mine[0]["bandwidth_mbps"] is None
            ):
                ax.axhline(
                    mine[0][metric], linestyle="--", color="0.3", label=f"{label} (no KV link)"
                )
                continue
            xs = [link_x(r["bandwidth_mbps"], links) for r in mine]
            ys = [r[metric] for r in mine]
            err = list(zip(*[_spread(doc, r, metric) for r in mine]))
            ax.errorbar(
                xs, ys, yerr=err, capsize=2, label=label, color=colours[label], **_line_style(label)
            )
        log_axes(ax, links)
        if values:  # horizontal lines do not widen the autoscaled range by themselves
            ax.set_ylim(min(values) / 1.5, max(values) * 1.5)
        ax.set_xlabel("bandwidth of the KV link (Mbit/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model}, {context}-token context")
        ax.grid(alpha=0.3, which="both")
    _one_legend(fig, axes, _order(doc))
    footnote(fig, _modes_note(doc) + " " + _missing_note(doc, kind))
    return fig


def _one_legend(fig, axes, order: list[str]) -> None:
    """One legend beside the panels, so it never hides a line, in the modes' ``order``."""
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    rank = {label: i for i, label in enumerate(order)}
    handles = dict(sorted(handles.items(), key=lambda kv: rank.get(kv[0].split(" (")[0], 0)))
    if handles:
        fig.legend(
            handles.values(), handles.keys(), loc="outside right upper", fontsize=8, title="mode"
        )


def _ttft_vs_bandwidth(doc: dict):
    return _lines_vs_bandwidth(
        doc,
        "e2e",
        "ttft_s",
        "TTFT (s, log scale)",
        "Time to first token vs bandwidth (vLLM)",
        ("recompute",),
    )


def _transfer_vs_bandwidth(doc: dict):
    return _lines_vs_bandwidth(
        doc,
        "stream",
        "transfer_s",
        "transfer time (s, log scale)",
        "KV transfer time vs bandwidth (real loopback socket, token-bucket shaper)",
        (),
    )


def _throughput(doc: dict):
    fig, model_panels = _model_panels(
        doc, "Output rate per request (vLLM, higher is better)", "e2e"
    )
    for ax, model, rows, labels in model_panels:
        contexts = sorted({r["context_tokens"] for r in rows})
        bw = max(
            (r["bandwidth_mbps"] for r in rows if r["bandwidth_mbps"] is not None), default=None
        )
        series = {}
        for context in contexts:
            points = []
            for label in labels:
                match = [
                    r
                    for r in rows
                    if _label(r) == label
                    and r["context_tokens"] == context
                    and r["bandwidth_mbps"] in (bw, None)
                ]
                points.append(
                    (match[0]["output_tokens_per_s"], _spread(doc, match[0], "output_tokens_per_s"))
                    if match
                    else (None, (0, 0))
                )
            series[f"{context} tokens"] = points
        _bars(ax, labels, series, "output tokens/s after the first token")
        ax.set_title(f"{model}" + (f", KV link {bw:g} Mbit/s" if bw else ""))
        ax.legend(title="context", fontsize=8)
    footnote(
        fig,
        "output_tokens_per_s: output tokens after the first / time from the first token to the "
        "last (docs/benchmarks.md, Vocabulary). " + _modes_note(doc),
    )
    return fig


def _compression_ratio(doc: dict):
    fig, model_panels = _model_panels(
        doc, "KV size reduction (higher is better)", "stream", largest_context=True
    )
    for ax, model, rows, labels in model_panels:
        context = rows[0]["context_tokens"]
        series = {}
        for metric, name in (("ratio_vs_fp16", "vs fp16"), ("ratio_vs_int8", "vs int8 per-token")):
            points = []
            for label in labels:
                values = [
                    r[metric] for r in rows if _label(r) == label and r.get(metric) is not None
                ]
                points.append((values[0] if values else None, (0.0, 0.0)))
            series[name] = points
        _bars(ax, labels, series, "size ratio (baseline bytes / bytes, x)")
        ax.axhline(1.0, color="0.3", linewidth=0.8)
        ax.set_title(f"{model}, {context}-token context (all overhead counted)")
        ax.legend(fontsize=8)
    footnote(fig, _missing_note(doc, "stream"))
    return fig


def _decode_time(doc: dict):
    fig, model_panels = _model_panels(
        doc, "Decode time of the whole context (lower is better)", "stream"
    )
    for ax, model, rows, labels in model_panels:
        contexts = sorted({r["context_tokens"] for r in rows})
        series = {}
        for context in contexts:
            points = []
            for label in labels:
                # Decoding does not depend on the link; the median over bandwidths is one number.
                match = [
                    r["decode_s"]
                    for r in rows
                    if _label(r) == label
                    and r["context_tokens"] == context
                    and r.get("decode_s") is not None
                ]
                points.append((sorted(match)[len(match) // 2] if match else None, (0.0, 0.0)))
            series[f"{context} tokens"] = points
        _bars(ax, labels, series, "decode time (s)")
        ax.set_title(f"{model}: entropy decode + dequantize")
        ax.legend(title="context", fontsize=8)
    footnote(fig, _modes_note(doc) + " " + _missing_note(doc, "stream"))
    return fig


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated by another with fewer (or equal) bits and lower (or equal) loss."""
    front = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def _quality_vs_size(doc: dict):
    fig, model_panels = _model_panels(doc, "Quality vs size (lower-left is better)", "quality")
    colours = mode_colours(doc)
    for ax, model, rows, _ in model_panels:
        for i, row in enumerate(sorted(rows, key=lambda r: r["bits_per_element"])):
            ax.scatter(
                row["bits_per_element"],
                row["ppl_change_pct"],
                s=40,
                zorder=3,
                color=colours.get(_label(row), "0.3"),
            )
            # Alternate above/below so neighbours of similar size (int8, fp8) stay legible.
            ax.annotate(
                _label(row),
                (row["bits_per_element"], row["ppl_change_pct"]),
                textcoords="offset points",
                xytext=(5, 5 if i % 2 == 0 else -12),
                fontsize=8,
            )
        front = pareto([(r["bits_per_element"], r["ppl_change_pct"]) for r in rows])
        ax.plot(
            [p[0] for p in front],
            [p[1] for p in front],
            "-",
            color="tab:red",
            alpha=0.6,
            label="Pareto frontier",
        )
        ax.set_xlabel("bits per KV element (everything counted)")
        ax.set_ylabel("perplexity change (%)")
        windows = sorted({r["windows"] for r in rows})
        contexts = sorted({r["context_tokens"] for r in rows})
        windows_text, contexts_text = "/".join(map(str, windows)), "/".join(map(str, contexts))
        ax.set_title(f"{model}, {windows_text} windows of {contexts_text} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    footnote(fig, _missing_note(doc, "quality"))
    return fig
