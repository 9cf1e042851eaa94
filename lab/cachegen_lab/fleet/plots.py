"""The figures of a ``cachegen fleet-bench`` document (``cachegen plot FLEET.json``), one PNG
each, one group of bars per run (configuration x link rate) in the document's order:

``fleet_ttft.png``
    TTFT p50, p90 and p99 of each run (of its requests without error);
``fleet_throughput.png``
    requests/s and output tokens/s of each run, one panel each.

Runs with failed or failed-over requests, and a configuration that ended the bench early, are
named under the figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cachegen.errors import InputError
from cachegen.fileio import check_version
from cachegen_lab.bench.links import link_label
from cachegen_lab.fleet.summary import READABLE, SCHEMA, validate

DPI = 110
PERCENTILES = (("p50", "ttft_p50_s"), ("p90", "ttft_p90_s"), ("p99", "ttft_p99_s"))
RATES = (
    ("requests/s", "requests_per_s"),
    ("output tokens/s", "output_tokens_per_s"),
)


def plot_fleet(doc: object, out_dir: str | Path, where: str) -> list[Path]:
    """Check that ``doc`` (read from ``where``) is a fleet-bench document of this version,
    then write ``fleet_ttft.png`` and ``fleet_throughput.png`` into ``out_dir``; their paths."""
    import matplotlib

    _check(doc, where)
    matplotlib.use("Agg")  # files only, never a window
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [
        _save(_ttft(doc), out / "fleet_ttft.png"),
        _save(_throughput(doc), out / "fleet_throughput.png"),
    ]


def _check(doc: object, where: str) -> None:
    import jsonschema

    check_version(doc, SCHEMA, READABLE, where)
    try:
        validate(doc)
    except jsonschema.ValidationError as exc:
        raise InputError(
            f"{where} is not a valid {SCHEMA!r} document: at {exc.json_path}, {exc.message}"
        ) from None


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def _run_label(run: dict[str, Any]) -> str:
    """``raw, 100 Mbit/s`` for a run of the connector, the configuration alone otherwise."""
    if run["bandwidth_mbps"] is None and not run["setup"].get("connector"):
        return run["config"]
    rate = link_label(run["bandwidth_mbps"])
    return f"{run['config']}, {rate}" + ("" if run["bandwidth_mbps"] is None else " Mbit/s")


def _subtitle(settings: dict[str, Any]) -> str:
    stop = settings["stop"]
    return (
        f"{settings['model']}, {settings['workload']} ({settings['requests']} requests), "
        f"{settings['servers']} servers, router {settings['router']}, "
        f"concurrency {settings['concurrency']}"
        + (
            ""
            if stop is None
            else f", server {stop['server']} stopped after {stop['after']} answers"
        )
    )


def _note(text: str, doc: dict[str, Any]) -> str:
    """``text``, then the runs with errors or failovers and the configuration that ended the
    bench early: the note under a figure."""
    troubles = [
        f"{_run_label(r)}: {r['summary']['errors']} failed, {r['summary']['failovers']} failed over"
        for r in doc["runs"]
        if r["summary"]["errors"] or r["summary"]["failovers"]
    ]
    if doc["failure"] is not None:
        troubles.append(f"ended early: {doc['failure']['config']} failed")
    return "; ".join([text, *troubles])


def _figure(panels: int, runs: int, title: str, subtitle: str, note: str):
    """A figure of ``panels`` panels side by side, each wide enough for ``runs`` groups."""
    import matplotlib.pyplot as plt

    width = max(6.4, 1.0 + 0.6 * runs)
    fig, axes = plt.subplots(
        1, panels, figsize=(width * panels, 4.2), squeeze=False, layout="constrained"
    )
    fig.suptitle(f"{title}\n{subtitle}", fontsize=12)
    fig.supxlabel(note, fontsize=8, color="0.35", wrap=True)
    return fig, list(axes[0])


def _bars(ax, runs: list[dict[str, Any]], series: tuple[tuple[str, str], ...], scale: float):
    """One group per run, one bar per ``(name, summary field)`` of ``series`` (times
    ``scale``); a field that is null draws no bar."""
    import numpy as np

    if not runs:
        ax.text(0.5, 0.5, "no runs in the document", ha="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    x = np.arange(len(runs))
    width = 0.8 / len(series)
    for i, (name, field) in enumerate(series):
        values = [r["summary"][field] for r in runs]
        heights = [0.0 if v is None else v * scale for v in values]
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, heights, width, label=name)
        for bar, value in zip(bars, values):
            bar.set_visible(value is not None)
    ax.set_xticks(x, [_run_label(r) for r in runs], rotation=30, ha="right")
    ax.grid(axis="y", alpha=0.3)


def _ttft(doc: dict[str, Any]):
    runs = doc["runs"]
    fig, (ax,) = _figure(
        1,
        len(runs),
        "Time to first token per run (lower is better)",
        _subtitle(doc["settings"]),
        _note("TTFT of the requests without error", doc),
    )
    _bars(ax, runs, PERCENTILES, 1000.0)
    ax.set_ylabel("TTFT (ms)")
    if runs:
        ax.legend(title="percentile", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def _throughput(doc: dict[str, Any]):
    runs = doc["runs"]
    fig, axes = _figure(
        len(RATES),
        len(runs),
        "Throughput per run (higher is better)",
        _subtitle(doc["settings"]),
        _note(
            "over each run's wall time, first send to last end; requests/s counts failed "
            "requests too, output tokens/s only those without error",
            doc,
        ),
    )
    for ax, (name, field) in zip(axes, RATES):
        _bars(ax, runs, ((name, field),), 1.0)
        ax.set_ylabel(name)
    return fig
