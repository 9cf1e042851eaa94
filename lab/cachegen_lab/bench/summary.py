"""The tables ``cachegen bench`` prints: medians per cell, then what was not measured."""

from __future__ import annotations

from cachegen.modes import Mode
from cachegen_lab.bench.links import link_label, link_order

COLUMNS = {  # key: (header, format) of each column the tables print
    "context_tokens": ("context", "{:d}"),
    "mode": ("mode", "{}"),
    "bandwidth_mbps": ("Mbit/s", "{:g}"),
    "ttft_s": ("TTFT s", "{:.3f}"),
    "e2e_s": ("e2e s", "{:.3f}"),
    "output_tokens_per_s": ("out tok/s", "{:.1f}"),
    "bytes": ("KV MB", "{:.2f}"),
    "loaded_tokens": ("loaded", "{:.0f}"),
    "n": ("n", "{:d}"),
    "bits_per_element": ("bits/elt", "{:.2f}"),
    "ratio_vs_fp16": ("x fp16", "{:.2f}"),
    "ratio_vs_int8": ("x int8", "{:.2f}"),
    "transfer_s": ("transfer s", "{:.3f}"),
    "decode_s": ("decode s", "{:.3f}"),
    "load_s": ("load s", "{:.3f}"),
    "ppl_change_pct": ("ppl change %", "{:+.2f}"),
    "top1_agreement": ("top-1 agree", "{:.3f}"),
    "windows": ("windows", "{:d}"),
}
CELL = ("context_tokens", "mode", "bandwidth_mbps")  # what a median row is of
E2E_COLUMNS = (*CELL, "ttft_s", "e2e_s", "output_tokens_per_s", "bytes", "loaded_tokens", "n")
STREAM_COLUMNS = (
    *CELL,
    "bytes",
    "bits_per_element",
    "ratio_vs_fp16",
    "ratio_vs_int8",
    "transfer_s",
    "decode_s",
    "load_s",
)
QUALITY_COLUMNS = ("mode", "bits_per_element", "ppl_change_pct", "top1_agreement", "windows")


def print_summary(doc: dict, file=None) -> None:
    for model in doc["config"]["models"]:
        e2e = [r for r in doc["medians"] if r["model"] == model and r["kind"] == "e2e"]
        stream = [r for r in doc["medians"] if r["model"] == model and r["kind"] == "stream"]
        quality = [r for r in doc["quality"] if r["model"] == model]
        _table(f"{model}: end to end through vLLM (medians)", e2e, E2E_COLUMNS, file)
        _table(
            f"{model}: codec + rate-limited socket, no vLLM (medians)", stream, STREAM_COLUMNS, file
        )
        _table(f"{model}: quality with decoded KV", quality, QUALITY_COLUMNS, file)
    if doc["missing"]:
        print("\nnot measured:", file=file)
        for m in doc["missing"]:
            where = " ".join(
                filter(
                    None,
                    [
                        f"{m['context_tokens']} tokens" if m.get("context_tokens") else "",
                        f"{m['bandwidth_mbps']:g} Mbit/s" if m.get("bandwidth_mbps") else "",
                    ],
                )
            )
            label = Mode(m["mode"], m["level"]).label
            print(
                f"  {m['kind']:<7} {m['model']} {label} {where}: {m['reason']}",
                file=file,
            )


def _table(title: str, rows: list[dict], columns: tuple[str, ...], file) -> None:
    if not rows:
        return
    rows = sorted(
        rows,
        key=lambda r: (
            r.get("context_tokens") or 0,
            Mode(r["mode"], r["level"]),
            _link_order(r),
        ),
    )
    cells = [[COLUMNS[key][0] for key in columns]]
    for r in rows:
        cells.append([_fmt(r, key, COLUMNS[key][1]) for key in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    print(f"\n{title}", file=file)
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), file=file)


def _link_order(row: dict) -> float:
    """Stream rows: the unlimited link last; elsewhere no bandwidth (recompute) first."""
    if row.get("kind") == "stream":
        return link_order(row.get("bandwidth_mbps"))
    return row.get("bandwidth_mbps") or 0


def _fmt(row: dict, key: str, fmt: str) -> str:
    if key == "mode":
        return Mode(row["mode"], row["level"]).label
    value = row.get(key)
    if key == "bandwidth_mbps" and row.get("kind") == "stream":
        return link_label(value)
    if value is None:
        return "-"
    if key == "bytes":
        value = value / 1e6
    return fmt.format(value)
