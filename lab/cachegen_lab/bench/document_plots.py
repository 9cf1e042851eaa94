"""Figures of the stored-forms documents (``cachegen plot``): load time per stored form and
adaptive's of ``cachegen stream-bench --forms``, and TTFT per mode of ``cachegen ttft table``,
each against the link's rate (medians, error bars over the repeats)."""

from __future__ import annotations

from pathlib import Path

from cachegen.fileio import check_version
from cachegen.modes import RECOMPUTE
from cachegen_lab.bench.links import link_label, link_order
from cachegen_lab.bench.modes import mode_name
from cachegen_lab.bench.plot_kit import footnote, link_x, log_axes, panels, runs_spread, save

FORMS_SCHEMA = "cachegen-stream-forms-bench"
TTFT_TABLE_SCHEMA = "cachegen-ttft-table"
DOCUMENTS = {FORMS_SCHEMA: (1, 2), TTFT_TABLE_SCHEMA: (1, 2, 3)}  # the versions these figures read


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
    return save(draw(doc), path)


def _forms_vs_bandwidth(doc: dict):
    """Load time of every stored form alone and of adaptive, per link rate (medians, bars
    over the repeats), recomputation as a dashed line; forms over the bound drawn faint."""
    columns = sorted(doc["columns"], key=lambda c: link_order(c["bandwidth_mbps"]))
    links = [c["bandwidth_mbps"] for c in columns]
    xs = [link_x(b, links) for b in links]
    fig, (ax,) = panels(
        1,
        f"Load time per stored form and adaptive's ({doc['model']}, {doc['tokens']} tokens, "
        f"bound {doc['max_loss_pct']:g}% perplexity)",
        width=8.0,
    )
    for form in doc["forms"]:
        name = form["name"]
        ys = [c["load_s"][name] for c in columns]
        err = list(
            zip(*[runs_spread(y, c["fixed_runs_load_s"][name]) for y, c in zip(ys, columns)])
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
                runs_spread(y, [r["completion_s"] for r in c["adaptive_runs"]])
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
    log_axes(ax, links)
    ax.set_xlabel("bandwidth of the KV link (Mbit/s)")
    ax.set_ylabel("load time (s, log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper right")
    ratios = ", ".join(
        f"{link_label(c['bandwidth_mbps'])}: {c['adaptive_vs_best']:.2f}" for c in columns
    )
    footnote(fig, f"adaptive / best allowed fixed form, per link: {ratios}")
    return fig


def _ttft_table(doc: dict):
    """TTFT per mode (and stored level) vs the link's rate through vLLM, one panel per
    context (medians, bars over the repeats); recomputation as a dashed line."""
    rows = doc["rows"]
    contexts = sorted({r["context_tokens"] for r in rows})
    fig, axes = panels(
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
            err = list(zip(*[runs_spread(r["ttft_s"], r["ttft_runs_s"]) for r in line]))
            bold = mode == "adaptive"
            ax.errorbar(
                [link_x(r["bandwidth_mbps"], links) for r in line],
                ys,
                yerr=err,
                marker="s" if bold else "o",
                capsize=2,
                color="black" if bold else None,
                linewidth=2.5 if bold else None,
                label=mode_name(mode, level),
            )
        log_axes(ax, links)
        ax.set_xlabel("bandwidth of the KV link (Mbit/s)")
        ax.set_ylabel("TTFT (s, log scale)")
        ax.set_title(f"{context}-token context")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8, loc="upper right")
    return fig
