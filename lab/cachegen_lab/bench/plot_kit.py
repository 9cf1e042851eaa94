"""Drawing pieces shared by the lab's figures (``plots`` of results.json, ``document_plots``
of the stored-forms and TTFT-table documents): panels, log-log bandwidth axes, error bars
over repeats, footnotes, and saving a figure as a PNG."""

from __future__ import annotations

from pathlib import Path

from cachegen_lab.bench.links import link_label

DPI = 110
UNLIMITED_X = 4.0  # the unlimited link's place on a bandwidth axis, past the fastest rate


def save(fig, path: Path) -> Path:
    """Write ``fig`` as the PNG ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def link_x(bandwidth: float | None, bandwidths: list[float | None]) -> float:
    """Where a link sits on a bandwidth axis: its rate, or the unlimited link past the rest."""
    if bandwidth is not None:
        return bandwidth
    return max((b for b in bandwidths if b is not None), default=1000.0) * UNLIMITED_X


def runs_spread(median: float, runs: list[float]) -> tuple[float, float]:
    """(median - min, max - median) of ``runs``: an error bar over the repeats."""
    return (median - min(runs), max(runs) - median) if runs else (0.0, 0.0)


def panels(n: int, title: str, width: float = 6.4, height: float = 4.2):
    """A figure of ``n`` panels side by side (at least one) and the list of their axes."""
    import matplotlib.pyplot as plt

    n = max(n, 1)
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False, layout="constrained")
    fig.suptitle(title, fontsize=13)
    return fig, list(axes[0])


def footnote(fig, text: str) -> None:
    """A note under the whole figure (constrained layout keeps it clear of the tick labels)."""
    if text.strip():
        fig.supxlabel(text.strip(), fontsize=8, color="0.35", wrap=True)


def log_axes(ax, bandwidths: list[float | None]) -> None:
    """Log-log axes with plain-number ticks at the configured bandwidths (the unlimited link,
    None, at the right: :func:`link_x`)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    xs = [link_x(b, bandwidths) for b in bandwidths]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(xs, [link_label(b) for b in bandwidths])
    ax.set_xlim(min(xs) / 1.4, max(xs) * 1.4)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
    ax.yaxis.set_minor_formatter(plain)
