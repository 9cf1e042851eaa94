"""``cachegen stream-bench``: real KV, real codec, real sockets, measured.

1. Tokenize CPython's documentation text (``pydoc_data.topics``, minus the topics the codec
   profile was calibrated on) and take the first ``tokens`` tokens (``bench_tokens``).
2. ``prepare``: if the store lacks any chunk in any needed form, prefill the model
   (transformers) to get the KV, encode each chunk in each form and write it. The prefill is
   timed: its rate (tokens/s) is what recomputation costs the controller, unless
   ``prefill_tps`` is given.
3. For each shaper and bandwidth, load all chunks through the link with pipelined decoding
   (``run_load``) and report bytes, transfer, decode, load time, goodput, waits and forms
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
from cachegen.modes import LEVELED, Form, configured_form
from cachegen.store import ChunkStore, RecordAddress, chunk_keys, stored_prefix
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

Choice = int | str  # what the adaptive controller picks: a coded level, or a form's name


def choice_of(form: Form) -> Choice:
    """The adaptive controller's name for ``form``: its level when it is a coded level of
    cachegen or tcq (the controller's ladder), else the form's name."""
    return form.level if form.codec in LEVELED and form.coded == form else form.label


@dataclass
class Prepared:
    """Chunks of one (model, codec, tokens) in a store, and what they cost to make."""

    model: str
    codec: str
    forms: list[Form]
    token_ids: torch.Tensor
    chunk_tokens: list[int]
    keys: list[str]
    sizes: dict[Form, list[int | None]]
    prefill_tps: float | None  # measured while preparing, if a prefill ran
    encoded_now: bool
    encode_s: dict[Form, float]  # seconds to encode every chunk, per form (when encoded now)
    kv_bytes_bf16: int
    kv: object = None  # the KV it was encoded from, when it was encoded now (not reported)

    def records(self, form: Form) -> list[RecordAddress]:
        """The records of every chunk in ``form``."""
        return [RecordAddress.of(key, form) for key in self.keys]

    def by_choice(self, values: dict[Form, object]) -> dict[Choice, object]:
        """``values`` per form keyed as the adaptive controller names the forms."""
        return {choice_of(form): value for form, value in values.items()}

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "codec": self.codec,
            "levels": [f.label for f in self.forms],  # the forms, by name
            "tokens": int(self.token_ids.numel()),
            "chunks": len(self.keys),
            "chunk_tokens": self.chunk_tokens[0] if self.chunk_tokens else None,
            "bytes_per_level": {f.label: sum(s) for f, s in self.sizes.items()},
            "kv_bytes_bf16": self.kv_bytes_bf16,
            "encoded_now": self.encoded_now,
            "encode_s": {f.label: s for f, s in self.encode_s.items()},
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
    forms: list[Form | int | str] | None = None,
    *,
    kv=None,
    log=None,
) -> Prepared:
    """Chunks of the tokens ``ids`` in ``store`` in ``forms`` of ``codec_name`` (``Form``
    values, levels, coded, or forms' names; default: every level of the codec, coded),
    encoded if any is missing (from ``kv``, their KV, when given; else from a timed
    prefill)."""
    from cachegen.profiles import codec_for

    log = log or (lambda msg: print(msg, file=sys.stderr))
    spec = models.resolve(model)
    codec = codec_for(codec_name, spec, chunk_tokens=chunk_tokens)
    forms = [
        f if isinstance(f, Form) else configured_form(f, codec_name)
        for f in (forms or codec.levels)
    ]
    for f in forms:
        if f.codec != codec_name:
            raise InputError(f"{f.label} is not a form of {codec_name}")
        codec.resolve_level(f.level)
    tokens = ids.numel()
    weights = spec.served_weights()  # the model served as it is, as `cachegen store put` keys it
    keys = chunk_keys(spec.identity(), codec.profile_id, ids, chunk_tokens, weights=weights)
    records = {f: [RecordAddress.of(key, f) for key in keys] for f in forms}
    tps = None
    encode_s = {}
    encoded = stored_prefix(store, list(zip(*records.values()))) < len(keys)
    if encoded:
        labels = ", ".join(f.label for f in forms)
        log(f"encoding {len(keys)} chunks x forms {labels} of {tokens} tokens of {spec.name} ...")
        if kv is None:
            tps, kv = measure_prefill_tps(spec, ids)
        encode_s = dict.fromkeys(forms, 0.0)
        for i, chunk in enumerate(kv.chunks(chunk_tokens)):
            for f in forms:
                begin = time.perf_counter()
                blob = encode_form(codec, chunk, f)
                encode_s[f] += time.perf_counter() - begin
                store.write(records[f][i], blob)
    sizes = {f: store.payload_sizes(records[f]) for f in forms}
    counts = [min(chunk_tokens, tokens - i * chunk_tokens) for i in range(len(keys))]
    ident = spec.identity()
    kv_bytes = tokens * ident.num_layers * ident.num_kv_heads * ident.head_dim * 2 * 2
    return Prepared(
        spec.name,
        codec_name,
        forms,
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


def encode_form(codec, chunk, form: Form) -> bytes:
    """``chunk`` encoded by ``codec`` in ``form``."""
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


def warm_up(store: ChunkStore, prep: Prepared) -> dict[Form, float]:
    """Decode every chunk in each form twice (the first pass warms kernels and caches) and
    return the second pass's decode seconds per token per form."""
    decode, consume = make_decoder(prep)
    out = {}
    for _ in range(2):
        for f in prep.forms:
            stats = stream_load(DirectSource(store), prep.records(f), decode, consume)
            out[f] = stats.decode_s / sum(prep.chunk_tokens)
    return out


def run_load(
    store, prep, *, shaper, bandwidth, rtt_ms, form=None, controller=None, check=True
) -> tuple[LoadStats, dict]:
    """One load of ``prep``'s chunks through a new link, in ``form`` or as ``controller``
    chooses; its stats and the link's description."""
    decode, consume = make_decoder(prep)
    if (form is None) == (controller is None):
        raise InputError("give exactly one of form= or controller=")
    # with a controller, the records only count and name the chunks: it picks their forms
    records = prep.records(form if form is not None else prep.forms[0])
    with open_link(store, bandwidth_mbps=bandwidth, rtt_ms=rtt_ms, shaper=shaper) as link:
        link_info = link.describe()
        stats = stream_load(
            link.source,
            records,
            decode,
            consume if check else (lambda i, kv: None),
            controller=controller,
        )
    return stats, link_info


def transfer_only(store, prep, *, shaper, bandwidth, rtt_ms, form) -> LoadStats:
    """A load with a no-op decoder: the transfer alone."""
    with open_link(store, bandwidth_mbps=bandwidth, rtt_ms=rtt_ms, shaper=shaper) as link:
        return stream_load(link.source, prep.records(form), len, lambda i, x: None)


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
    form = None if level is None else configured_form(level, prep.codec)
    decode_spt = warm_up(store, prep)
    decode_alone = {f: spt * sum(prep.chunk_tokens) for f, spt in decode_spt.items()}
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
                    form=form,
                    controller=controller,
                )
                row = load_row(stats, link, prep, level, prefill_tps)
                row.loadavg_1min = [load_before, os.getloadavg()[0]]
                if standalone and form is not None:
                    alone = transfer_only(
                        store, prep, shaper=shaper, bandwidth=bw, rtt_ms=rtt_ms, form=form
                    )
                    row.transfer_alone_s = alone.load_s
                    row.goodput_alone_mbps = alone.goodput_mbps
                    row.decode_alone_s = decode_alone[form]
                    row.pipeline_ratio_vs_alone = stats.load_s / max(
                        alone.load_s, decode_alone[form]
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
            "decode_s_per_token": {f.label: spt for f, spt in decode_spt.items()},
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
    (None: the controller chose); its ``levels`` are the forms each chunk was loaded in."""
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
        mean_level=statistics.fmean(
            Form.parse(f).level or 0 for f in stats.forms if f not in (None, RECOMPUTE)
        )
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
    work = Workload(
        prep.by_choice(prep.sizes), prep.chunk_tokens, prep.by_choice(decode_spt), prefill_tps
    )
    traces = standard_traces(rates, seeds)
    out = versioned(
        EVAL_SCHEMA,
        VERSION,
        {
            "prepared": prep.to_dict(),
            "prefill_tps": prefill_tps,
            "decode_s_per_token": {f.label: spt for f, spt in decode_spt.items()},
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
                "real_levels": [_choice(f) for f in stats.forms],
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
    """The adaptive controller of a load of ``prep`` within ``slo_ms`` (``decode_spt``: the
    decode seconds per token of each form)."""
    return AdaptiveController(
        slo_ms / 1000,
        prep.by_choice(prep.sizes),
        prep.chunk_tokens,
        prefill_tokens_per_s=prefill_tps,
        decode_s_per_token=prep.by_choice(decode_spt),
        drop_factor=drop_factor,
    )


def _choice(label: str | None) -> Choice | None:
    """A loaded chunk's form as the simulation names it (``choice_of``): what the real and
    the simulated loads are compared by."""
    return label if label in (None, RECOMPUTE) else choice_of(Form.parse(label))


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
