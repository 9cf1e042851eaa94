"""PNG figures from results.json, and from the stored-forms documents of ``cachegen
stream-bench --forms`` and ``cachegen ttft table`` (``cachegen plot``).

Every figure is drawn from the medians (error bars span the repeats' min..max), names its
units, and says so in the panel when a mode was asked for but not measured, instead of
leaving it out silently.
"""

from __future__ import annotations

from pathlib import Path

from cachegen.fileio import check_version
from cachegen.lab.bench.links import link_label, link_order
from cachegen.lab.bench.modes import mode_name
from cachegen.lab.bench.results import lookup
from cachegen.modes import RECOMPUTE, Mode

FIGURES = (
    "ttft_by_mode",
    "ttft_vs_bandwidth",
    "throughput",
    "compression_ratio",
    "transfer_vs_bandwidth",
    "decode_time",
    "quality_vs_size",
)
DPI = 110
UNLIMITED_X = 4.0  # the unlimited link's place on a bandwidth axis, past the fastest rate


def plot_all(doc: dict, out_dir: str | Path) -> list[Path]:
    """Write every figure into ``out_dir``; returns the paths in ``FIGURES`` order."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in FIGURES:
        fig = globals()[f"_{name}"](doc)
        path = out / f"{name}.png"
        fig.savefig(path, dpi=DPI, bbox_inches="tight")
        _close(fig)
        paths.append(path)
    return paths


# ---- helpers -----------------------------------------------------------------------------


def _close(fig) -> None:
    import matplotlib.pyplot as plt

    plt.close(fig)


def _label(row: dict) -> str:
    return Mode(row["mode"], row["level"]).label


def _order(doc: dict) -> list[str]:
    """Mode labels in the order the sweep was configured with."""
    return list(doc["config"]["modes"])


def _link_x(bandwidth: float | None, bandwidths: list[float | None]) -> float:
    """Where a link sits on a bandwidth axis: its rate, or the unlimited link past the rest."""
    if bandwidth is not None:
        return bandwidth
    return max((b for b in bandwidths if b is not None), default=1000.0) * UNLIMITED_X


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
    return _runs_spread(row[metric], values)


def _missing_note(doc: dict, kind: str, model: str | None = None) -> str:
    rows = [
        m for m in doc["missing"] if m["kind"] == kind and (model is None or m["model"] == model)
    ]
    if not rows:
        return ""
    labels = sorted({Mode(m["mode"], m["level"]).label for m in rows})
    return "not measured: " + ", ".join(labels)


def _panels(n: int, title: str, width: float = 6.4, height: float = 4.2):
    import matplotlib.pyplot as plt

    n = max(n, 1)
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, layout="constrained")
    fig.suptitle(title, fontsize=13)
    return fig, list(axes[0])


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


def _footnote(fig, text: str) -> None:
    """A note under the whole figure (constrained layout keeps it clear of the tick labels)."""
    if text.strip():
        fig.supxlabel(text.strip(), fontsize=8, color="0.35", wrap=True)


def _log_axes(ax, bandwidths: list[float | None]) -> None:
    """Log-log axes with plain-number ticks at the configured bandwidths (the unlimited link,
    None, at the right: ``_link_x``)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    xs = [_link_x(b, bandwidths) for b in bandwidths]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [link_label(b) for b in bandwidths])
    ax.set_xlim(min(xs) / 1.4, max(xs) * 1.4)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(plain)


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
    fig, axes = _panels(len(models), title)
    panels = []
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
        panels.append((ax, model, rows, labels))
    return fig, panels


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
    fig, panels = _model_panels(
        doc, "Time to first token by mode (vLLM, lower is better)", "e2e", largest_context=True
    )
    for ax, model, rows, labels in panels:
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
    _footnote(
        fig,
        "recompute moves no KV: its bar is the same at every bandwidth. "
        + _missing_note(doc, "e2e"),
    )
    return fig


def _lines_vs_bandwidth(
    doc: dict, kind: str, metric: str, ylabel: str, title: str, flat_modes: tuple[str, ...]
):
    models = _models(doc)
    panels = [
        (m, c)
        for m in models
        for c in sorted({r["context_tokens"] for r in lookup(doc, kind=kind, model=m)})
    ]
    fig, axes = _panels(len(panels), title)
    if not panels:
        _empty(axes[0], f"no {kind} runs\n{_missing_note(doc, kind)}")
        return fig
    # Stream runs also cover rates above the end-to-end grid and the unlimited link (None).
    links = doc["config"]["bandwidth_mbps"]
    if kind == "stream":
        links = doc["config"].get("stream_bandwidth_mbps") or links
    for ax, (model, context) in zip(axes, panels):
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
            xs = [_link_x(r["bandwidth_mbps"], links) for r in mine]
            ys = [r[metric] for r in mine]
            err = list(zip(*[_spread(doc, r, metric) for r in mine]))
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=2, label=label)
        _log_axes(ax, links)
        if values:  # horizontal lines do not widen the autoscaled range by themselves
            ax.set_ylim(min(values) / 1.5, max(values) * 1.5)
        ax.set_xlabel("bandwidth of the KV link (Mbit/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{model}, {context}-token context")
        ax.grid(alpha=0.3, which="both")
    # One legend beside the panels, so it never hides a line.
    handles = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    if handles:
        fig.legend(
            handles.values(), handles.keys(), loc="outside right upper", fontsize=8, title="mode"
        )
    _footnote(fig, _missing_note(doc, kind))
    return fig


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
    fig, panels = _model_panels(doc, "Output rate per request (vLLM, higher is better)", "e2e")
    for ax, model, rows, labels in panels:
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
    _footnote(
        fig,
        "output_tokens_per_s: output tokens after the first / time from the first token to the "
        "last (docs/benchmarks.md, Vocabulary)",
    )
    return fig


def _compression_ratio(doc: dict):
    fig, panels = _model_panels(
        doc, "KV size reduction (higher is better)", "stream", largest_context=True
    )
    for ax, model, rows, labels in panels:
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
    _footnote(fig, _missing_note(doc, "stream"))
    return fig


def _decode_time(doc: dict):
    fig, panels = _model_panels(doc, "Decode time of the whole context (lower is better)", "stream")
    for ax, model, rows, labels in panels:
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
    _footnote(fig, _missing_note(doc, "stream"))
    return fig


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated by another with fewer (or equal) bits and lower (or equal) loss."""
    front = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            front.append((x, y))
    return front


def _quality_vs_size(doc: dict):
    fig, panels = _model_panels(doc, "Quality vs size (lower-left is better)", "quality")
    for ax, model, rows, _ in panels:
        for i, row in enumerate(sorted(rows, key=lambda r: r["bits_per_element"])):
            ax.scatter(row["bits_per_element"], row["ppl_change_pct"], s=40, zorder=3)
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
    _footnote(fig, _missing_note(doc, "quality"))
    return fig


# ---- the stored forms: stream-bench --forms and ttft table documents ------------------------

FORMS_SCHEMA = "cachegen-stream-forms-bench"
TTFT_TABLE_SCHEMA = "cachegen-ttft-table"
DOCUMENTS = {FORMS_SCHEMA: (1,), TTFT_TABLE_SCHEMA: (1,)}  # the versions these figures read


def plot_document(doc: dict, path: str | Path, where: str) -> Path:
    """Draw the figure of a ``cachegen stream-bench --forms`` document (load time per form and
    adaptive's vs bandwidth) or of a ``cachegen ttft table`` document (TTFT per mode vs
    bandwidth) into the PNG ``path``; a version these figures do not read is refused, naming
    ``where`` the document came from."""
    import matplotlib

    check_version(doc, doc["schema"], DOCUMENTS[doc["schema"]], where)
    matplotlib.use("Agg")
    draw = {FORMS_SCHEMA: _forms_vs_bandwidth, TTFT_TABLE_SCHEMA: _ttft_table}[doc["schema"]]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = draw(doc)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    _close(fig)
    return path


def _runs_spread(median: float, runs: list[float]) -> tuple[float, float]:
    return (median - min(runs), max(runs) - median) if runs else (0.0, 0.0)


def _forms_vs_bandwidth(doc: dict):
    """Load time of every stored form alone and of adaptive, per link rate (medians, bars
    over the repeats), recomputation as a dashed line; forms over the bound drawn faint."""
    columns = sorted(doc["columns"], key=lambda c: link_order(c["bandwidth_mbps"]))
    links = [c["bandwidth_mbps"] for c in columns]
    xs = [_link_x(b, links) for b in links]
    fig, (ax,) = _panels(
        1,
        f"Load time per stored form and adaptive's ({doc['model']}, {doc['tokens']} tokens, "
        f"bound {doc['max_loss_pct']:g}% perplexity)",
        width=8.0,
    )
    for form in doc["forms"]:
        name = form["name"]
        ys = [c["load_s"][name] for c in columns]
        err = list(
            zip(*[_runs_spread(y, c["fixed_runs_load_s"][name]) for y, c in zip(ys, columns)])
        )
        label = f"{name} ({form['bytes'] / 1e6:.1f} MB)"
        if not form["allowed"]:
            label += ", over the bound"
        ax.errorbar(
            xs,
            ys,
            yerr=err,
            marker="o",
            capsize=2,
            label=label,
            alpha=1.0 if form["allowed"] else 0.35,
        )
    ys = [c["adaptive_s"] for c in columns]
    err = list(
        zip(
            *[
                _runs_spread(y, [r["completion_s"] for r in c["adaptive_runs"]])
                for y, c in zip(ys, columns)
            ]
        )
    )
    ax.errorbar(
        xs, ys, yerr=err, marker="s", capsize=2, color="black", linewidth=2.5, label="adaptive"
    )
    recompute = {c["recompute_s"] for c in columns}
    if len(recompute) == 1:
        ax.axhline(recompute.pop(), linestyle="--", color="0.3", label="recompute (no KV link)")
    _log_axes(ax, links)
    ax.set_xlabel("bandwidth of the KV link (Mbit/s)")
    ax.set_ylabel("load time (s, log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right")
    ratios = ", ".join(
        f"{link_label(c['bandwidth_mbps'])}: {c['adaptive_vs_best']:.2f}" for c in columns
    )
    _footnote(fig, f"adaptive / best allowed fixed form, per link: {ratios}")
    return fig


def _ttft_table(doc: dict):
    """TTFT per mode (and stored level) vs the link's rate through vLLM, one panel per
    context (medians, bars over the repeats); recomputation as a dashed line."""
    rows = doc["rows"]
    contexts = sorted({r["context_tokens"] for r in rows})
    fig, axes = _panels(
        len(contexts), f"Time to first token vs bandwidth ({rows[0]['model']}, vLLM)"
    )
    for ax, context in zip(axes, contexts):
        mine = [r for r in rows if r["context_tokens"] == context]
        links = sorted(
            {r["bandwidth_mbps"] for r in mine if r["mode"] != RECOMPUTE}, key=link_order
        )
        for mode, level in dict.fromkeys((r["mode"], r["level"]) for r in mine):
            line = sorted(
                (r for r in mine if (r["mode"], r["level"]) == (mode, level)),
                key=lambda r: link_order(r["bandwidth_mbps"]),
            )
            if mode == RECOMPUTE:
                ax.axhline(line[0]["ttft_s"], linestyle="--", color="0.3", label="recompute")
                continue
            ys = [r["ttft_s"] for r in line]
            err = list(zip(*[_runs_spread(r["ttft_s"], r["ttft_runs_s"]) for r in line]))
            bold = mode == "adaptive"
            ax.errorbar(
                [_link_x(r["bandwidth_mbps"], links) for r in line],
                ys,
                yerr=err,
                marker="s" if bold else "o",
                capsize=2,
                color="black" if bold else None,
                linewidth=2.5 if bold else None,
                label=mode_name(mode, level),
            )
        _log_axes(ax, links)
        ax.set_xlabel("bandwidth of the KV link (Mbit/s)")
        ax.set_ylabel("TTFT (s, log scale)")
        ax.set_title(f"{context}-token context")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    return fig
