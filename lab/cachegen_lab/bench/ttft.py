"""Time to first token through vLLM with the cachegen connector, per mode, level and bandwidth.

Python (one engine, many measurements; what ``cachegen bench`` calls):

    with TTFTBench("smollm2-135m") as bench:
        prompt = bench.prompt(4096)                # 4096 context tokens + a question
        bench.prepare(prompt)                      # prefill once, store every encoding
        row = bench.measure(prompt, "cachegen", level=1, bandwidth_mbps=100)
        row["ttft_s"], row["bytes"], row["levels"]

    measure_ttft("smollm2-135m", "int8", None, 100, 1536)   # one-shot (starts its own engine)

Command line (the table in docs/connector.md):

    cachegen ttft table --contexts 1536 4096 --bandwidths 100 500 1000 5000 20000 unlimited
    cachegen ttft placement     # where the connector's work runs
    cachegen ttft timeline      # TTFT = load + what follows it

``recompute`` means no KV from the store (vLLM prefills the whole prompt); every other mode loads
the context's chunks through a token-bucket link of the given rate, or with no rate limit
(``unlimited``, bandwidth None).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cachegen import workload
from cachegen.errors import InputError
from cachegen.models import EMBEDDED_DEFAULT
from cachegen.modes import CACHEGEN, LEVELED, RECOMPUTE, Form, Mode
from cachegen_lab.bench.engine import ConnectorEngine
from cachegen_lab.bench.links import UNLIMITED, link_order
from cachegen_lab.bench.modes import mode_name
from cachegen_lab.rows import RequestRow, TTFTRow

SAVE_MODES = ("raw", "int8", "fp8", "cachegen")
DEFAULT_MODES = (RECOMPUTE, "raw", "int8", "fp8", "cachegen", "adaptive")
DEFAULT_SLO_MS = 1000.0
OUTPUT_TOKENS = 16


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


class TTFTBench:
    """One in-process vLLM engine with the connector, reused for every measurement.

    ``store`` defaults to a fresh temporary directory, removed by :meth:`close`. ``engine``
    measures on an existing :class:`ConnectorEngine` instead of starting one (it is then
    left running by :meth:`close`).
    """

    def __init__(
        self,
        model: str = EMBEDDED_DEFAULT,
        *,
        store: str | None = None,
        chunk_tokens: int = 256,
        save_modes: Sequence[str] = SAVE_MODES,
        load_async: bool = True,
        save_async: bool = True,
        engine: ConnectorEngine | None = None,
        **engine_args: Any,
    ) -> None:
        self._tmp = None
        self._owns_engine = engine is None
        if engine is None:
            if "cachegen" in save_modes:  # the tables measure every level, not the default ladder
                from cachegen.profiles import codec_for

                engine_args.setdefault("cachegen_levels", codec_for("cachegen", model).levels)
            self._tmp = None if store else tempfile.mkdtemp(prefix="cachegen-ttft-")
            store = store or Path(self._tmp).as_uri()
            engine = ConnectorEngine(
                model,
                store=store,
                chunk_tokens=chunk_tokens,
                save_modes=save_modes,
                load_async=load_async,
                save_async=save_async,
                **engine_args,
            )
        self.engine = engine
        self.chunk_tokens = engine.config.chunk_tokens
        self.model = self.engine.spec.name
        self._prepared: set[tuple[int, ...]] = set()
        self._warm = False
        self._links_started: set[float | None] = set()

    # ---- prompts -------------------------------------------------------------------------------

    def prompt(
        self, context_tokens: int, question: str = workload.SUMMARY_QUESTION, offset: int = 0
    ) -> list[int]:
        """``context_tokens`` tokens of real text (the workload's eval split)
        followed by ``question``. Use a multiple of ``chunk_tokens`` so the whole context loads."""
        text = workload.text("eval")[offset:]
        ids = self.engine.tokenize(text[: 8 * context_tokens])
        if len(ids) < context_tokens:
            raise InputError(
                f"the evaluation text has fewer than {context_tokens} tokens after offset {offset}"
            )
        return ids[:context_tokens] + self.engine.tokenize(question, bos=False)

    # ---- measurements --------------------------------------------------------------------------

    def prepare(self, prompt: Sequence[int]) -> dict[str, Any]:
        """Prefill ``prompt`` from text once and wait until every save mode is stored."""
        key = tuple(prompt)
        t0 = time.perf_counter()
        if key not in self._prepared:
            self.engine.store_prefix(prompt)
            self._prepared.add(key)
        return {"prepare_s": time.perf_counter() - t0}

    def warm_up(self, prompt: Sequence[int]) -> None:
        """First requests pay one-time costs (allocator, kernels, the codec's compiled kernels
        and tables): spend them here, on a prompt whose prefix is stored if it was prepared."""
        if not self._warm:
            self.engine.run(prompt, max_tokens=2)
            modes = (
                [m for m in self.engine.config.save_modes if m != "adaptive"]
                if tuple(prompt) in self._prepared
                else []
            )
            for mode in modes or ["raw"]:
                self.engine.run(prompt, mode=mode, max_tokens=2)
            self._warm = True

    def measure(
        self,
        prompt: Sequence[int],
        mode: str,
        level: int | str | None = None,
        bandwidth_mbps: float | None = None,
        *,
        slo_ms: float | None = None,
        repeats: int = 3,
        max_tokens: int = OUTPUT_TOKENS,
    ) -> dict[str, Any]:
        """Median TTFT over ``repeats`` runs of ``prompt`` (already :meth:`prepare`-d) in
        ``mode`` at ``level`` (a coded level, or a form's name: ``cachegen-11-packed``).

        Returns a :class:`~cachegen_lab.rows.TTFTRow` as a dict: ``ttft_s`` (vLLM's
        RequestOutput.metrics.first_token_latency), ``ttft_wall_s``, ``e2e_s``,
        ``output_tokens_per_s`` (medians), every run's ``ttft_runs_s``, and the last run's
        tokens vLLM did not compute (``cached_tokens``), output and connector report
        (``loaded_tokens``, ``bytes``, ``levels`` (each chunk's form), ``transfer_s``,
        ``decode_s``, ``inject_s``, ``load_s``, ``goodput_mbps``, ``load_error``).
        """
        if repeats < 1:
            raise InputError("repeats must be >= 1")
        if mode == "adaptive" and slo_ms is None:
            slo_ms = DEFAULT_SLO_MS
        self.warm_up(prompt)
        if mode != RECOMPUTE and bandwidth_mbps not in self._links_started:
            # The first load at a new rate starts that link's chunk server: not part of a TTFT.
            self.engine.run(prompt, mode="raw", bandwidth_mbps=bandwidth_mbps, max_tokens=2)
            self._links_started.add(bandwidth_mbps)
        measurements = [
            self.engine.run(
                prompt,
                mode=mode,
                level=level,
                bandwidth_mbps=None if mode == RECOMPUTE else bandwidth_mbps,
                slo_ms=slo_ms,
                max_tokens=max_tokens,
            )
            for _ in range(repeats)
        ]
        runs = [RequestRow.from_measurement(m, self.model) for m in measurements]
        row = TTFTRow(
            **runs[-1].to_dict(),
            shaper=self.engine.shaper,
            repeats=repeats,
            ttft_runs_s=[r.ttft_s for r in runs],
            output_token_ids=measurements[-1].token_ids,
        )
        for name in ("ttft_s", "ttft_wall_s", "e2e_s", "output_tokens_per_s"):
            setattr(row, name, _median([getattr(r, name) for r in runs]))
        return row.to_dict()

    def close(self) -> None:
        if self._owns_engine:
            self.engine.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> TTFTBench:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def measure_ttft(
    model: str,
    mode: str,
    level: int | str | None,
    bandwidth_mbps: float | None,
    context_tokens: int,
    *,
    slo_ms: float | None = None,
    repeats: int = 3,
    store: str | None = None,
) -> dict[str, Any]:
    """One measurement with its own engine (it pays vLLM's start-up): prefer :class:`TTFTBench`
    for many."""
    with TTFTBench(model, store=store) as bench:
        prompt = bench.prompt(context_tokens)
        bench.prepare(prompt)
        return bench.measure(prompt, mode, level, bandwidth_mbps, slo_ms=slo_ms, repeats=repeats)


# ---- the TTFT table ------------------------------------------------------------------------------


def ttft_table(
    bench: TTFTBench,
    contexts: Sequence[int],
    bandwidths: Sequence[float],
    modes: Sequence[str] = DEFAULT_MODES,
    *,
    slo_ms: float = DEFAULT_SLO_MS,
    repeats: int = 3,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Rows for every context x mode (x stored form of ``cachegen`` and ``tcq``) x bandwidth;
    ``recompute`` once per context."""
    rows = []
    transport = bench.engine.transport
    levels = {m: [bench_level(f) for f in transport.forms(m)] for m in LEVELED if m in modes}
    for context in contexts:
        prompt = bench.prompt(context)
        bench.prepare(prompt)
        bench.warm_up(prompt)
        for mode in modes:
            for level in levels.get(mode, [None]):
                for bandwidth in [None] if mode == RECOMPUTE else bandwidths:
                    row = bench.measure(
                        prompt,
                        mode,
                        level,
                        bandwidth,
                        slo_ms=slo_ms if mode == "adaptive" else None,
                        repeats=repeats,
                    )
                    row["context_tokens"] = context
                    rows.append(row)
                    if progress:
                        print(
                            f"context {context} {mode} level={level} {_column(bandwidth)}: "
                            f"TTFT {row['ttft_s']:.3f} s",
                            file=sys.stderr,
                        )
    return rows


def bench_level(form: Form) -> int | str:
    """How a row names ``form`` of its mode: a coded level by its number, another form (a
    packed one) by its name."""
    return form.level if form.coded == form else form.label


def _column(bandwidth_mbps: float | None) -> str:
    return UNLIMITED if bandwidth_mbps is None else f"{bandwidth_mbps:g} Mbit/s"


def markdown(rows: Sequence[dict[str, Any]], max_loss_pct: float | None = None) -> str:
    """One table per context: TTFT (s) per mode and bandwidth, with size and speed-ups;
    ``max_loss_pct``: the engine's bound for ``adaptive`` (its rows' SLO is then unused)."""
    out = []
    for context in sorted({r["context_tokens"] for r in rows}):
        mine = [r for r in rows if r["context_tokens"] == context]
        # Every link a KV mode ran over, the unlimited one (None) last.
        bandwidths = sorted(
            {r["bandwidth_mbps"] for r in mine if r["mode"] != RECOMPUTE}, key=link_order
        )
        recompute = next((r for r in mine if r["mode"] == RECOMPUTE), None)
        int8 = {r["bandwidth_mbps"]: r for r in mine if r["mode"] == "int8"}
        out.append(
            f"**{context}-token context** (+ {mine[0]['prompt_tokens'] - context}-token question), "
            f"TTFT in seconds (median of {mine[0]['repeats']}), "
            f"link shaped by {mine[0]['shaper']}; "
            f"x = TTFT of recompute / int8 over this row's"
        )
        out.append("")
        head = "| mode | KV size (MB) | " + " | ".join(_column(b) for b in bandwidths) + " |"
        out.append(head)
        out.append("|" + " --- |" * (2 + len(bandwidths)))
        if recompute is not None:
            out.append(
                "| recompute | - | "
                + " | ".join(f"{recompute['ttft_s']:.3f}" for _ in bandwidths)
                + " |"
            )
        for mode, level in dict.fromkeys(
            (r["mode"], r["level"]) for r in mine if r["mode"] != RECOMPUTE
        ):
            cells = []
            size = None
            for b in bandwidths:
                r = next(
                    (
                        x
                        for x in mine
                        if x["mode"] == mode and x["level"] == level and x["bandwidth_mbps"] == b
                    ),
                    None,
                )
                if r is None:
                    cells.append("-")
                    continue
                size = r["bytes"] or size
                cell = f"{r['ttft_s']:.3f}"
                ratios = []
                if recompute is not None:
                    ratios.append(f"{recompute['ttft_s'] / r['ttft_s']:.1f}x recompute")
                if mode != "int8" and b in int8:
                    ratios.append(f"{int8[b]['ttft_s'] / r['ttft_s']:.1f}x int8")
                if mode == "adaptive" and r.get("levels"):
                    ratios.append("levels " + _levels_text(r["levels"]))
                cells.append(cell + (f" ({'; '.join(ratios)})" if ratios else ""))
            name = mode_name(mode, level)
            if mode == "adaptive" and max_loss_pct is not None:
                name += f" (fastest form within {max_loss_pct:g}% loss)"
            elif mode == "adaptive":
                slo = next(r["slo_ms"] for r in mine if r["mode"] == "adaptive")
                name += f" (SLO {slo:g} ms)"
            out.append(
                f"| {name} | {size / 1e6 if size else float('nan'):.2f} | "
                + " | ".join(cells)
                + " |"
            )
        out.append("")
    return "\n".join(out)


def _levels_text(levels: Sequence[Any]) -> str:
    """Each chunk's form (earlier rows: its level), or for choices among several codecs
    and packings each form with its count."""
    if all(isinstance(x, int) or x == RECOMPUTE for x in levels):
        return ",".join(str(x) for x in levels)
    forms = {Form.parse(x) for x in levels if x != RECOMPUTE}
    if len({(f.codec, f.packing) for f in forms}) == 1:  # one codec's coded levels: the levels
        return ",".join(x if x == RECOMPUTE else str(Form.parse(x).level) for x in levels)
    counts = Counter(str(x) for x in levels)
    return ", ".join(f"{name} x{count}" for name, count in counts.items())


# ---- where a load's TTFT goes --------------------------------------------------------------------


def timeline(
    bench: TTFTBench,
    context_tokens: int,
    modes: Sequence[tuple[str, int | str | None]],
    bandwidth_mbps: float | None,
    repeats: int = 3,
) -> list[dict[str, Any]]:
    """Split TTFT around the load, per mode: medians over ``repeats`` runs of one prompt.

    ``load_s`` is the connector's load (first request to last chunk injected);
    ``after_load_s`` = TTFT - ``load_s`` (vLLM noticing the load finished, scheduling the
    request and computing its uncached tokens); ``first_token_step_s`` the engine step that
    computed the uncached tokens and produced the first token; ``steps`` the engine steps
    from submission to the first token (idle steps while the load runs included).
    """
    prompt = bench.prompt(context_tokens)
    bench.prepare(prompt)
    bench.warm_up(prompt)
    rows = []
    for mode, level in modes:
        bandwidth = None if mode == RECOMPUTE else bandwidth_mbps
        bench.measure(prompt, mode, level, bandwidth, repeats=1, max_tokens=2)  # starts the link
        runs = []
        for _ in range(repeats):
            request = bench.engine.submit(
                prompt,
                mode=mode,
                level=level,
                bandwidth_mbps=bandwidth,
                max_tokens=2,
                slo_ms=DEFAULT_SLO_MS if mode == "adaptive" else None,
            )
            bench.engine.step_until_done([request])
            m = request.measurement()
            load_s = m.connector.get("load_s", 0.0)
            runs.append(
                {
                    "ttft_s": m.ttft_s,
                    "load_s": load_s,
                    "after_load_s": m.ttft_s - load_s,
                    "first_token_step_s": request.first_token_step_s,
                    "steps": request.steps_to_first_token,
                    "loaded_tokens": m.connector.get("loaded_tokens", 0),
                }
            )
        row = {
            "model": bench.model,
            "mode": mode,
            "level": level,
            "bandwidth_mbps": bandwidth,
            "context_tokens": context_tokens,
            "prompt_tokens": len(prompt),
            "repeats": repeats,
            "runs": runs,
        }
        row.update(
            {
                key: _median([r[key] for r in runs])
                for key in ("ttft_s", "load_s", "after_load_s", "first_token_step_s", "steps")
            }
        )
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}), file=sys.stderr)
    return rows


def timeline_markdown(rows: Sequence[dict[str, Any]]) -> str:
    out = [
        "| mode | link (Mbit/s) | TTFT (s) | load (s) | TTFT - load (s) | first-token step (s) "
        "| steps to first token |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        name = mode_name(r["mode"], r["level"])
        link = "-" if r["bandwidth_mbps"] is None else f"{r['bandwidth_mbps']:g}"
        out.append(
            f"| {name} | {link} | {r['ttft_s']:.3f} | {r['load_s']:.3f} "
            f"| {r['after_load_s']:.3f} | "
            f"{r['first_token_step_s']:.3f} | {r['steps']:g} |"
        )
    return "\n".join(out)


def parse_mode(label: str) -> tuple[str, int | None]:
    """A mode label (``cachegen.modes``); bare ``cachegen`` means the model's default level."""
    if label == CACHEGEN:
        return CACHEGEN, None
    mode = Mode.parse(label)
    return mode.mode, mode.level


# ---- where the connector's work runs -------------------------------------------------------------


def placement(
    model: str, context_tokens: int = 1536, bandwidth_mbps: float = 100.0, repeats: int = 3
) -> list[dict[str, Any]]:
    """Measure the load and save placements against each other (docs/connector.md).

    Per setting, one engine. Alone: A's TTFT when it is the only request (loads: its
    ``context_tokens`` context in raw bf16 at ``bandwidth_mbps``, a transfer-bound load, and
    at the codec's default cachegen level over an unlimited link, a decode-bound load).
    Together: the engine decodes request B (64 tokens) when A arrives; A loads raw at
    ``bandwidth_mbps`` (loads) or prefills a context not stored yet and stores every save
    mode (saves). Reported: A's TTFT, B's longest and median gap between two tokens from the
    gap A's arrival interrupts until B finished.
    """
    rows = []
    settings = [
        ("load", {"load_async": False}),
        ("load", {"load_async": True}),
        ("save", {"save_async": False}),
        ("save", {"save_async": True}),
    ]
    for kind, flags in settings:
        with TTFTBench(model, **flags) as bench:
            engine = bench.engine
            a_prompt = bench.prompt(context_tokens)
            b_prompt = bench.prompt(512, offset=100_000)
            bench.warm_up(a_prompt)
            if kind == "load":
                bench.prepare(a_prompt)
                for mode, bandwidth in (("raw", bandwidth_mbps), ("cachegen", None)):
                    row = bench.measure(a_prompt, mode, bandwidth_mbps=bandwidth, repeats=repeats)
                    rows.append(
                        {
                            "setting": kind,
                            **flags,
                            "case": f"alone {mode} {bandwidth or 'unlimited'}",
                            "a_ttft_s": row["ttft_s"],
                            "a_ttft_runs_s": row["ttft_runs_s"],
                            "a_load_s": row.get("load_s"),
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr)
            for repeat in range(repeats):
                b = engine.submit(b_prompt, max_tokens=64)
                engine.step_until_done([b], until=lambda: len(b.token_times) >= 8)
                if kind == "load":
                    a = engine.submit(a_prompt, mode="raw", bandwidth_mbps=bandwidth_mbps)
                else:  # a context not stored yet, so that every repeat encodes and stores
                    fresh = bench.prompt(context_tokens, offset=30_000 * (repeat + 1))
                    a = engine.submit(fresh, save=True)
                engine.step_until_done([a, b])
                before = [t for t in b.token_times if t < a.t_submit][
                    -1:
                ]  # the gap A's arrival interrupts
                window = before + [t for t in b.token_times if t >= a.t_submit]
                gaps = [y - x for x, y in zip(window, window[1:])]
                rows.append(
                    {
                        "setting": kind,
                        **flags,
                        "case": "with B decoding",
                        "repeat": repeat,
                        "a_ttft_s": a.measurement().ttft_s,
                        "b_max_gap_s": max(gaps, default=float("nan")),
                        "b_median_gap_s": _median(gaps),
                        "a_connector": a.measurement().connector,
                    }
                )
                print(
                    json.dumps({k: v for k, v in rows[-1].items() if k != "a_connector"}),
                    file=sys.stderr,
                )
                if kind == "save":
                    engine.wait_stored(fresh)  # the next repeat starts with an idle saver
    return rows


def placement_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Medians per setting and case."""
    out = [
        "| work | runs in | case | A's TTFT (s) | B's longest gap (s) | B's median gap (s) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        flag = "load_async" if r["setting"] == "load" else "save_async"
        groups.setdefault((r["setting"], r[flag], r["case"]), []).append(r)
    for (kind, background, case), group in groups.items():
        where = "background thread" if background else "engine step (inline)"
        ttft = _median([x for r in group for x in r.get("a_ttft_runs_s", [r["a_ttft_s"]])])
        gap = [r["b_max_gap_s"] for r in group if "b_max_gap_s" in r]
        median_gap = [r["b_median_gap_s"] for r in group if "b_median_gap_s" in r]
        out.append(
            f"| {kind} | {where} | {case} | {ttft:.2f} | "
            f"{_median(gap):.2f} | {_median(median_gap):.2f} |"
            if gap
            else f"| {kind} | {where} | {case} | {ttft:.2f} | - | - |"
        )
    return "\n".join(out)
