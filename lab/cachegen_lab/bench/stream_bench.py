"""``cachegen stream-bench``: real KV, real codec, real sockets, measured.

1. Tokenize CPython's documentation text (``pydoc_data.topics``, minus the topics the codec
   profile was calibrated on) and take the first ``tokens`` tokens (``bench_tokens``).
2. ``prepare``: if the store lacks any chunk at any needed level, prefill the model
   (transformers) to get the KV, encode each chunk at each level and put it. The prefill is
   timed: its rate (tokens/s) is what recomputation costs the controller, unless
   ``prefill_tps`` is given.
3. For each shaper and bandwidth, load all chunks through the link with pipelined decoding
   (``run_load``) and report bytes, transfer, decode, load time, goodput, waits and levels
   (``load_row``, a :class:`~cachegen_lab.rows.StreamRow`).

The sweep's ``stream`` part (``measure_stream``) is made of the same three steps.
``controller_eval`` evaluates the adaptive controller over bandwidth traces instead.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from cachegen import models, workload
from cachegen.errors import InputError
from cachegen.fileio import versioned
from cachegen.modes import CODED, Form
from cachegen.store import ChunkStore, chunk_keys, longest_prefix
from cachegen.stream.controller import DEFAULT_DROP_FACTOR, RECOMPUTE, AdaptiveController
from cachegen.stream.loader import LoadStats, stream_load
from cachegen.stream.source import DirectSource
from cachegen_lab.bench.links import UNLIMITED
from cachegen_lab.experiments.stream_sim import ADAPTIVE, Workload, evaluate, standard_traces
from cachegen_lab.network.link import open_link
from cachegen_lab.network.traces import BandwidthTrace
from cachegen_lab.rows import StreamRow

SCHEMA = "cachegen-stream-bench"
LINK_BOUND_SLACK = 0.05  # transfer-only goodput this far under the rate still counts as the link
EVAL_SCHEMA = "cachegen-stream-controller-eval"
VERSION = 1


@dataclass
class Prepared:
    """Chunks of one (model, codec, tokens) in a store, and what they cost to make."""

    model: str
    codec: str
    levels: list[int]
    token_ids: torch.Tensor
    chunk_tokens: list[int]
    keys: list[str]
    sizes: dict[int, list[int]]
    prefill_tps: float | None  # measured while preparing, if a prefill ran
    encoded_now: bool
    encode_s: dict[int, float]  # seconds to encode every chunk, per level (when encoded now)
    kv_bytes_bf16: int
    kv: object = None  # the KV it was encoded from, when it was encoded now (not reported)

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "codec": self.codec,
            "levels": self.levels,
            "tokens": int(self.token_ids.numel()),
            "chunks": len(self.keys),
            "chunk_tokens": self.chunk_tokens[0] if self.chunk_tokens else None,
            "bytes_per_level": {str(lv): sum(s) for lv, s in self.sizes.items()},
            "kv_bytes_bf16": self.kv_bytes_bf16,
            "encoded_now": self.encoded_now,
            "encode_s": {str(lv): s for lv, s in self.encode_s.items()},
        }


def bench_tokens(spec: models.ModelSpec, tokens: int) -> torch.Tensor:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(spec.path)(workload.text("eval"))["input_ids"]
    if tokens > min(len(ids), spec.max_positions):
        raise InputError(
            f"--tokens {tokens} exceeds the {min(len(ids), spec.max_positions)} available "
            f"for {spec.name}"
        )
    return torch.tensor(ids[:tokens], dtype=torch.int64)


def measure_prefill_tps(spec: models.ModelSpec, token_ids: torch.Tensor) -> tuple[float, object]:
    """Prefill rate (tokens/s) of ``extract_kv`` over ``token_ids``, model load excluded."""
    from cachegen.extract import extract_kv, load_model

    load_model(spec)
    extract_kv(spec, token_ids=token_ids[:32])  # first-call overheads are not prefill cost
    start = time.perf_counter()
    kv = extract_kv(spec, token_ids=token_ids, prefill_chunk_tokens=512)
    return token_ids.numel() / (time.perf_counter() - start), kv


def prepare(
    store: ChunkStore,
    model: str,
    codec_name: str,
    ids: torch.Tensor,
    chunk_tokens: int,
    levels: list[int] | None = None,
    *,
    kv=None,
    log=None,
) -> Prepared:
    """Chunks of the tokens ``ids`` in ``store`` at ``levels`` (store level slots,
    ``cachegen.modes.Form.slot``: a packed form's has bit 15 set), encoded if any is missing
    (from ``kv``, their KV, when given; else from a timed prefill)."""
    from cachegen.profiles import codec_for

    log = log or (lambda msg: print(msg, file=sys.stderr))
    spec = models.resolve(model)
    codec = codec_for(codec_name, spec, chunk_tokens=chunk_tokens)
    levels = list(levels or codec.levels)
    for lv in levels:
        codec.resolve_level(Form.from_slot(codec_name, lv).level)
    tokens = ids.numel()
    keys = chunk_keys(spec.identity(), codec.profile_id, ids, chunk_tokens)
    tps = None
    encode_s = {}
    encoded = longest_prefix(store, keys, levels) < len(keys)
    if encoded:
        log(f"encoding {len(keys)} chunks x levels {levels} of {tokens} tokens of {spec.name} ...")
        if kv is None:
            tps, kv = measure_prefill_tps(spec, ids)
        encode_s = dict.fromkeys(levels, 0.0)
        for key, chunk in zip(keys, kv.chunks(chunk_tokens)):
            for lv in levels:
                begin = time.perf_counter()
                blob = encode_slot(codec, chunk, lv)
                encode_s[lv] += time.perf_counter() - begin
                store.put(key, lv, blob)
    sizes = {lv: store.sizes(keys, lv) for lv in levels}
    counts = [min(chunk_tokens, tokens - i * chunk_tokens) for i in range(len(keys))]
    ident = spec.identity()
    kv_bytes = tokens * ident.num_layers * ident.num_kv_heads * ident.head_dim * 2 * 2
    return Prepared(
        spec.name,
        codec_name,
        levels,
        ids,
        counts,
        keys,
        sizes,
        tps,
        encoded,
        encode_s,
        kv_bytes,
        kv if encoded else None,
    )


def encode_slot(codec, chunk, slot: int) -> bytes:
    """``chunk`` encoded for the store level slot ``slot`` of ``codec`` (``Form.slot``)."""
    form = Form.from_slot(codec.name, slot)
    if form.packing == CODED:
        return codec.encode(chunk, level=form.level)
    return codec.encode(chunk, form.level, form.packing)


def make_decoder(expected: Prepared):
    """The real codec's decode, plus a consumer that checks each chunk is the right tokens."""
    from cachegen.codec import decode

    def consume(index: int, kv) -> None:
        begin = sum(expected.chunk_tokens[:index])
        if not torch.equal(
            kv.token_ids, expected.token_ids[begin : begin + expected.chunk_tokens[index]]
        ):
            raise InputError(
                f"chunk {index} decoded to other tokens than stored: the store holds foreign data"
            )

    return decode, consume


def warm_up(store: ChunkStore, prep: Prepared) -> dict[int, float]:
    """Decode every chunk at each level twice (the first pass warms kernels and caches) and
    return the second pass's decode seconds per token per level."""
    decode, consume = make_decoder(prep)
    out = {}
    for _ in range(2):
        for lv in prep.levels:
            stats = stream_load(DirectSource(store), prep.keys, decode, consume, level=lv)
            out[lv] = stats.decode_s / sum(prep.chunk_tokens)
    return out


def run_load(
    store, prep, *, shaper, bandwidth, rtt_ms, level=None, controller=None, check=True
) -> tuple[LoadStats, dict]:
    """One load of ``prep``'s chunks through a new link; its stats and the link's description."""
    decode, consume = make_decoder(prep)
    with open_link(store, bandwidth_mbps=bandwidth, rtt_ms=rtt_ms, shaper=shaper) as link:
        link_info = link.describe()
        stats = stream_load(
            link.source,
            prep.keys,
            decode,
            consume if check else (lambda i, kv: None),
            level=level,
            controller=controller,
        )
    return stats, link_info


def transfer_only(store, prep, *, shaper, bandwidth, rtt_ms, level) -> LoadStats:
    """A load with a no-op decoder: the transfer alone."""
    with open_link(store, bandwidth_mbps=bandwidth, rtt_ms=rtt_ms, shaper=shaper) as link:
        return stream_load(link.source, prep.keys, len, lambda i, x: None, level=level)


def stream_bench(
    store: ChunkStore,
    prep: Prepared,
    *,
    shapers,
    bandwidths,
    rtt_ms,
    level=None,
    slo_ms=None,
    prefill_tps=None,
    repeat=1,
    standalone=True,
    log=None,
) -> dict:
    log = log or (lambda msg: print(msg, file=sys.stderr))
    if (level is None) == (slo_ms is None):
        raise InputError("give exactly one of --level or --slo-ms")
    decode_spt = warm_up(store, prep)
    decode_alone = {lv: spt * sum(prep.chunk_tokens) for lv, spt in decode_spt.items()}
    runs = []
    for shaper in shapers:
        for bw in bandwidths:
            for rep in range(repeat):
                controller = None
                if slo_ms is not None:
                    if not prefill_tps:
                        raise InputError(
                            "--slo-ms needs a prefill rate: pass --prefill-tps or let the bench "
                            "measure it"
                        )
                    controller = _controller(prep, slo_ms, prefill_tps, decode_spt)
                load_before = os.getloadavg()[0]
                stats, link = run_load(
                    store,
                    prep,
                    shaper=shaper,
                    bandwidth=bw,
                    rtt_ms=rtt_ms,
                    level=level,
                    controller=controller,
                )
                row = load_row(stats, link, prep, level, prefill_tps)
                row.loadavg_1min = [load_before, os.getloadavg()[0]]
                if standalone and level is not None:
                    alone = transfer_only(
                        store, prep, shaper=shaper, bandwidth=bw, rtt_ms=rtt_ms, level=level
                    )
                    row.transfer_alone_s = alone.load_s
                    row.goodput_alone_mbps = alone.goodput_mbps
                    row.decode_alone_s = decode_alone[level]
                    row.pipeline_ratio_vs_alone = stats.load_s / max(
                        alone.load_s, decode_alone[level]
                    )
                runs.append(row.to_dict())
                rate = bw if bw is not None else UNLIMITED
                log(
                    f"{shaper:>12} {rate:>9} Mbit/s  goodput {row.goodput_mbps:8.1f}"
                    f"  load {row.load_s:.3f} s  transfer {row.transfer_s:.3f} s"
                    f"  decode {row.decode_s:.3f} s  ratio {row.pipeline_ratio:.3f}"
                )
    return versioned(
        SCHEMA,
        VERSION,
        {
            "prepared": prep.to_dict(),
            "prefill_tps": prefill_tps,
            "decode_s_per_token": decode_spt,
            "summary": summarize(runs),
            "runs": runs,
        },
    )


SUMMARY_FIELDS = (
    "goodput_mbps",
    "goodput_alone_mbps",
    "transfer_s",
    "decode_s",
    "load_s",
    "pipeline_ratio",
    "pipeline_ratio_vs_alone",
    "ttft_model_s",
    "mean_level",
)


def summarize(runs: list[dict]) -> list[dict]:
    """Median of each measurement per (shaper, bandwidth): this machine is shared, so single
    runs can be slowed by other jobs; the load average is recorded with every run."""
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["shaper"], r["bandwidth_mbps"], r["trace"]), []).append(r)
    out = []
    for (shaper, bw, trace), rows in groups.items():
        entry = {
            "shaper": shaper,
            "bandwidth_mbps": bw,
            "trace": trace,
            "runs": len(rows),
            "bytes": rows[0]["bytes"],
        }
        for f in SUMMARY_FIELDS:
            values = [r[f] for r in rows if r.get(f) is not None]
            entry[f] = statistics.median(values) if values else None
        if bw and entry["goodput_alone_mbps"] is not None:
            entry["goodput_alone_error"] = entry["goodput_alone_mbps"] / bw - 1
            # Link-bound: the transfer alone keeps up with the configured rate; host-bound:
            # the sender, the receiver or the verification cannot, whatever the shaper.
            entry["bound"] = "link" if entry["goodput_alone_error"] >= -LINK_BOUND_SLACK else "host"
        out.append(entry)
    return out


def load_row(
    stats: LoadStats, link: dict, prep: Prepared, level: int | None, prefill_tps: float | None
) -> StreamRow:
    """The row of one load through ``link`` (its ``describe()``; empty: no link) at ``level``
    (None: the controller chose)."""
    recompute_tokens = (
        sum(prep.chunk_tokens[stats.recompute_from :]) if stats.recompute_from is not None else 0
    )
    bandwidth = link.get("bandwidth_mbps")  # None: unlimited or a trace
    return StreamRow(
        model=prep.model,
        codec=prep.codec,
        level=level,
        shaper=link.get("shaper"),
        trace=link.get("trace"),
        bandwidth_mbps=bandwidth,
        rtt_ms=link.get("rtt_ms"),
        rtt_emulation=link.get("rtt_emulation"),
        netns=link.get("netns"),
        qdisc=link.get("qdisc"),
        context_tokens=sum(prep.chunk_tokens),
        loaded_tokens=sum(prep.chunk_tokens[: stats.n_loaded]),
        n_chunks=stats.n_chunks,
        n_loaded=stats.n_loaded,
        recompute_from=stats.recompute_from,
        recompute_tokens=recompute_tokens,
        **StreamRow.measures(stats.to_dict()),
        consume_s=stats.consume_s,
        wait_bytes_s=stats.wait_bytes_s,
        wait_decoder_s=stats.wait_decoder_s,
        goodput_error=stats.goodput_mbps / bandwidth - 1 if bandwidth else None,
        pipeline_ratio=stats.load_s / max(stats.transfer_s, stats.decode_s),
        ttft_model_s=stats.load_s + (recompute_tokens / prefill_tps if prefill_tps else 0.0),
        mean_level=statistics.fmean(lv for lv in stats.levels if lv != RECOMPUTE)
        if stats.n_loaded
        else None,
        decisions=list(stats.decisions),
    )


def controller_eval(
    store: ChunkStore,
    prep: Prepared,
    *,
    slos_ms,
    prefill_tps,
    rtt_ms=0.0,
    rates=(100, 200, 500, 1000),
    seeds=8,
    real_runs=0,
    drop_factors=(DEFAULT_DROP_FACTOR,),
    log=None,
) -> dict:
    """Simulated evaluation over standard traces, plus ``real_runs`` traces replayed over a real
    socket."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    decode_spt = warm_up(store, prep)
    work = Workload(prep.sizes, prep.chunk_tokens, decode_spt, prefill_tps)
    traces = standard_traces(rates, seeds)
    out = versioned(
        EVAL_SCHEMA,
        VERSION,
        {
            "prepared": prep.to_dict(),
            "prefill_tps": prefill_tps,
            "decode_s_per_token": decode_spt,
            "evaluations": [],
        },
    )
    for drop_factor in drop_factors:
        for slo_ms in slos_ms:
            result = evaluate(
                traces, work, slo_s=slo_ms / 1000, rtt_s=rtt_ms / 1000, drop_factor=drop_factor
            )
            sim_runs = result.pop("runs")
            result["real"] = _real_replays(
                store,
                prep,
                traces,
                sim_runs,
                slo_ms,
                prefill_tps,
                decode_spt,
                rtt_ms,
                real_runs,
                drop_factor,
            )
            out["evaluations"].append(result)
    return out


def _real_replays(
    store, prep, traces, sim_runs, slo_ms, prefill_tps, decode_spt, rtt_ms, count, drop_factor
) -> list[dict]:
    """Replay the first ``count`` traces of each kind over the token bucket with the adaptive
    controller."""
    picked = []
    for kind in ("constant", "step", "walk"):
        picked += [i for i, t in enumerate(traces) if t.name.startswith(kind)][:count]
    rows = []
    for i in picked:
        ctrl = _controller(prep, slo_ms, prefill_tps, decode_spt, drop_factor)
        stats, _ = run_load(
            store,
            prep,
            shaper="token-bucket",
            bandwidth=traces[i],
            rtt_ms=rtt_ms,
            controller=ctrl,
            check=False,
        )
        row = load_row(stats, {}, prep, None, prefill_tps)
        sim = sim_runs[ADAPTIVE][i]
        rows.append(
            {
                "trace": traces[i].name,
                "real_ttft_s": row.ttft_model_s,
                "sim_ttft_s": sim["ttft_s"],
                "real_hit": row.ttft_model_s <= slo_ms / 1000,
                "sim_hit": sim["hit"],
                "real_mean_level": row.mean_level,
                "sim_mean_level": sim["mean_level"],
                "real_levels": stats.levels,
                "sim_levels": sim["levels"],
            }
        )
    return rows


def _controller(
    prep: Prepared,
    slo_ms: float,
    prefill_tps: float,
    decode_spt: dict,
    drop_factor: float = DEFAULT_DROP_FACTOR,
) -> AdaptiveController:
    """The adaptive controller of a load of ``prep`` within ``slo_ms``."""
    return AdaptiveController(
        slo_ms / 1000,
        prep.sizes,
        prep.chunk_tokens,
        prefill_tokens_per_s=prefill_tps,
        decode_s_per_token=decode_spt,
        drop_factor=drop_factor,
    )


def parse_bandwidths(text: str | None) -> list:
    if text is None:
        return [None]
    if ":" in text:
        return [BandwidthTrace.parse(text)]
    try:
        return [None if x.strip() == UNLIMITED else float(x) for x in text.split(",")]
    except ValueError:
        raise InputError(
            f"--bandwidth-mbps {text!r}: give numbers (100 or 100,500,1000,{UNLIMITED}) or a "
            "trace spec"
        ) from None
