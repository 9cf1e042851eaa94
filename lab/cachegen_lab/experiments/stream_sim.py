"""Deterministic simulation of a load over a bandwidth trace, for evaluating the controller.

It replays the loader's schedule (see loader.py) in simulated time, driving the very same
``AdaptiveController``: chunk i starts on the link at max(end of chunk i-1, its request + RTT)
and ends when the trace has carried its bytes; with the controller, chunk i+1 is decided
when ``lookahead`` of chunk i has arrived, from the throughput over that part; decoding is
pipelined (chunk i decodes after it arrived and after chunk i-1 decoded). Not modelled: the
token bucket's burst and backpressure from a full decode buffer. TTFT here is the load
time plus the time to recompute the chunks left to recomputation; the prefill of the
prompt's uncached suffix is the same for every policy and left out.

``evaluate`` runs every policy (each fixed level, always-recompute, adaptive) over many
traces and summarises SLO hit rate, mean level and TTFT. ``cachegen stream-bench
--controller-eval`` prints that table and checks it against real-socket runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from cachegen.stream.controller import DEFAULT_DROP_FACTOR, RECOMPUTE, AdaptiveController
from cachegen_lab.network.traces import BandwidthTrace

ADAPTIVE = "adaptive"


@dataclass
class SimResult:
    policy: str  # "L<level>", "recompute" or "adaptive"
    trace: str
    ttft_s: float
    load_s: float
    levels: list  # per chunk: level or "recompute"
    slo_s: float

    @property
    def hit(self) -> bool:
        return self.ttft_s <= self.slo_s

    @property
    def mean_level(self) -> float | None:
        loaded = [lv for lv in self.levels if lv != RECOMPUTE]
        return statistics.fmean(loaded) if loaded else None

    @property
    def recompute_share(self) -> float:
        return sum(lv == RECOMPUTE for lv in self.levels) / max(1, len(self.levels))

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "hit": self.hit,
            "mean_level": self.mean_level,
            "recompute_share": self.recompute_share,
        }


@dataclass(frozen=True)
class Workload:
    """What is loaded: per-level chunk sizes (bytes), tokens per chunk, decode and prefill costs."""

    sizes: Mapping[int, Sequence[int]]
    chunk_tokens: Sequence[int]
    decode_s_per_token: Mapping[int, float]
    prefill_tokens_per_s: float

    @property
    def levels(self) -> list[int]:
        return sorted(self.sizes)

    def recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s


def simulate(
    trace: BandwidthTrace,
    work: Workload,
    policy: int | str,
    *,
    slo_s: float,
    rtt_s: float = 0.0,
    lookahead: float = 0.5,
    initial_mbps: float | None = None,
    safety: float = 1.0,
    drop_factor: float = DEFAULT_DROP_FACTOR,
) -> SimResult:
    n = len(work.chunk_tokens)
    name = policy if isinstance(policy, str) else f"L{policy}"
    if policy == RECOMPUTE:
        t = work.recompute_s(sum(work.chunk_tokens))
        return SimResult(name, trace.name, t, 0.0, [RECOMPUTE] * n, slo_s)
    ctrl = None
    if policy == ADAPTIVE:
        ctrl = AdaptiveController(
            slo_s,
            work.sizes,
            work.chunk_tokens,
            prefill_tokens_per_s=work.prefill_tokens_per_s,
            initial_mbps=initial_mbps,
            safety=safety,
            drop_factor=drop_factor,
            decode_s_per_token=work.decode_s_per_token,
        )
    levels, load_s = _load(trace, work, policy, ctrl, rtt_s, lookahead)
    ttft = load_s
    if RECOMPUTE in levels:
        ttft += work.recompute_s(sum(work.chunk_tokens[levels.index(RECOMPUTE) :]))
    return SimResult(name, trace.name, ttft, load_s, levels, slo_s)


def _load(
    trace: BandwidthTrace,
    work: Workload,
    policy: int | str,
    ctrl: AdaptiveController | None,
    rtt_s: float,
    lookahead: float,
) -> tuple[list, float]:
    """The loader's schedule at a fixed level (``ctrl`` None) or as ``ctrl`` decides: each
    chunk's level (``RECOMPUTE`` from the first one left to recomputation) and the time the
    last loaded chunk is decoded."""
    n = len(work.chunk_tokens)
    levels: list = [RECOMPUTE] * n
    decodes: list[tuple[float, int, float]] = []  # (end time, chunk, seconds), not yet reported

    def decide(i: int, now: float, inflight: int) -> int | str:
        if ctrl is None:
            return int(policy)
        while decodes and decodes[0][0] <= now:
            _, j, sec = decodes.pop(0)
            ctrl.observe_decode(j, sec)
        return ctrl.choose(i, now, inflight)

    req = [0.0] * n  # request times
    prev_end = 0.0  # end of the previous chunk's transfer
    dec_end = 0.0
    choice = decide(0, 0.0, 0)
    for i in range(n):
        if choice == RECOMPUTE:
            break
        levels[i] = choice
        size = work.sizes[choice][i]
        start = max(prev_end, req[i] + rtt_s)
        base = trace.bytes_until(start)
        end = trace.time_at_bytes(base + size)
        next_choice = None
        if i + 1 < n:
            if ctrl is None:
                next_choice = choice
                req[i + 1] = 0.0
            else:
                t_mid = trace.time_at_bytes(base + lookahead * size)
                if t_mid > start:
                    ctrl.observe_throughput(int(lookahead * size), t_mid - start)
                next_choice = decide(i + 1, t_mid, int((1 - lookahead) * size))
                req[i + 1] = t_mid
        if ctrl is not None:
            ctrl.observe_throughput(size, end - max(prev_end, req[i]))
        prev_end = end
        decode_s = work.decode_s_per_token[choice] * work.chunk_tokens[i]
        dec_end = max(end, dec_end) + decode_s
        decodes.append((dec_end, i, decode_s))
        choice = next_choice
    return levels, dec_end


def evaluate(
    traces: Sequence[BandwidthTrace],
    work: Workload,
    *,
    slo_s: float,
    rtt_s: float = 0.0,
    safety: float = 1.0,
    drop_factor: float = DEFAULT_DROP_FACTOR,
) -> dict:
    """Every policy over every trace: per-policy summary plus the adaptive-vs-fixed comparison."""
    policies: list = [*work.levels, RECOMPUTE, ADAPTIVE]
    runs = {
        p: [
            simulate(t, work, p, slo_s=slo_s, rtt_s=rtt_s, safety=safety, drop_factor=drop_factor)
            for t in traces
        ]
        for p in policies
    }
    summary = []
    for p in policies:
        rs = runs[p]
        ttfts = sorted(r.ttft_s for r in rs)
        levels = [r.mean_level for r in rs if r.mean_level is not None]
        summary.append(
            {
                "policy": rs[0].policy,
                "runs": len(rs),
                "slo_hit_rate": sum(r.hit for r in rs) / len(rs),
                "mean_level": statistics.fmean(levels) if levels else None,
                "recompute_share": statistics.fmean(r.recompute_share for r in rs),
                "mean_ttft_s": statistics.fmean(ttfts),
                "p95_ttft_s": ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))],
            }
        )
    adaptive = runs[ADAPTIVE]
    feasible = [k for k in range(len(traces)) if any(runs[lv][k].hit for lv in work.levels)]
    versus = []
    for lv in work.levels:
        met = [k for k in range(len(traces)) if runs[lv][k].hit]
        if met:
            versus.append(
                {
                    "fixed_level": lv,
                    "runs_fixed_meets_slo": len(met),
                    "adaptive_hit_rate": sum(adaptive[k].hit for k in met) / len(met),
                    "adaptive_mean_level": statistics.fmean(
                        adaptive[k].mean_level or 0.0 for k in met
                    ),
                }
            )
    # The fixed level to beat: the highest one that meets the SLO at least as often as adaptive.
    hit = {row["policy"]: row["slo_hit_rate"] for row in summary}
    peers = [lv for lv in work.levels if hit[f"L{lv}"] >= hit[ADAPTIVE]]
    return {
        "slo_s": slo_s,
        "rtt_s": rtt_s,
        "drop_factor": drop_factor,
        "traces": [t.name for t in traces],
        "summary": summary,
        "feasible_runs": len(feasible),
        "adaptive_hit_rate_where_feasible": (
            sum(adaptive[k].hit for k in feasible) / len(feasible) if feasible else None
        ),
        "adaptive_vs_fixed": versus,
        "comparable_fixed_level": peers[-1] if peers else None,
        "runs": {str(p): [r.to_dict() for r in rs] for p, rs in runs.items()},
    }


def standard_traces(
    rates_mbps: Sequence[float] = (100, 200, 500, 1000), seeds: int = 8
) -> list[BandwidthTrace]:
    """Constant, step-drop and random-walk traces around each rate."""
    traces = []
    for rate in rates_mbps:
        traces.append(BandwidthTrace.constant(rate))
        for at in (0.05, 0.2, 0.5):
            traces.append(BandwidthTrace.step(rate * 2, rate / 2, at))
        traces.extend(BandwidthTrace.random_walk(rate, seed) for seed in range(seeds))
    return traces
