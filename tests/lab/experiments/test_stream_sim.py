"""The trace simulator and the controller evaluation (deterministic, no clocks)."""

from __future__ import annotations

import pytest

from cachegen.stream import RECOMPUTE
from cachegen_lab.experiments.stream_sim import (
    ADAPTIVE,
    Workload,
    evaluate,
    simulate,
    standard_traces,
)
from cachegen_lab.network import BandwidthTrace

N = 8
WORK = Workload(
    sizes={0: [125_000] * N, 1: [250_000] * N, 2: [500_000] * N},
    chunk_tokens=[256] * N,
    decode_s_per_token={0: 1e-6, 1: 1e-6, 2: 1e-6},
    prefill_tokens_per_s=2048.0,
)


def test_fixed_level_time_is_bytes_over_rate():
    r = simulate(BandwidthTrace.constant(80), WORK, 1, slo_s=10.0)  # 10 MB/s, 2 MB in total
    assert r.load_s == pytest.approx(0.2 + 256e-6)  # the last chunk's decode is not overlapped
    assert r.levels == [1] * N and r.hit and r.mean_level == 1


def test_rtt_delays_only_the_first_byte_when_requests_are_pipelined():
    base = simulate(BandwidthTrace.constant(80), WORK, 0, slo_s=10.0)
    rtt = simulate(BandwidthTrace.constant(80), WORK, 0, slo_s=10.0, rtt_s=0.05)
    assert rtt.load_s - base.load_s == pytest.approx(0.05)


def test_recompute_policy():
    r = simulate(BandwidthTrace.constant(80), WORK, RECOMPUTE, slo_s=0.5)
    assert r.ttft_s == pytest.approx(1.0) and not r.hit and r.recompute_share == 1


def test_adaptive_uses_the_slack_and_backs_off_after_a_drop():
    greedy = simulate(BandwidthTrace.constant(80), WORK, ADAPTIVE, slo_s=0.3, drop_factor=1.0)
    assert greedy.hit and greedy.levels[0] == 0 and max(greedy.levels) == 2
    assert (
        simulate(BandwidthTrace.constant(80), WORK, 2, slo_s=0.3).hit is False
    )  # 0.4 s at level 2
    careful = simulate(
        BandwidthTrace.constant(80), WORK, ADAPTIVE, slo_s=0.3
    )  # keeps room for a drop
    assert careful.hit and 0 < careful.mean_level <= greedy.mean_level
    # 20 MB/s, then 2 MB/s from 50 ms on: level 2 while fast, lower once the drop is seen
    drop = simulate(BandwidthTrace.step(160, 16, 0.05), WORK, ADAPTIVE, slo_s=1.0)
    assert drop.hit and not simulate(BandwidthTrace.step(160, 16, 0.05), WORK, 2, slo_s=1.0).hit
    assert drop.levels[1] == 2 and max(drop.levels[4:]) < 2


def test_adaptive_recomputes_on_a_dead_link():
    r = simulate(BandwidthTrace.constant(0.1), WORK, ADAPTIVE, slo_s=1.5)
    assert r.levels[0] == 0 and all(lv == RECOMPUTE for lv in r.levels[1:])
    assert r.ttft_s == pytest.approx(r.load_s + 7 * 256 / 2048)


def test_evaluate_reports_every_policy():
    traces = standard_traces(rates_mbps=(40, 80), seeds=2)
    out = evaluate(traces, WORK, slo_s=0.5)
    assert [row["policy"] for row in out["summary"]] == ["L0", "L1", "L2", RECOMPUTE, ADAPTIVE]
    assert all(len(runs) == len(traces) for runs in out["runs"].values())
    assert 0 < out["feasible_runs"] <= len(traces)
    assert 0 <= out["adaptive_hit_rate_where_feasible"] <= 1
    assert out["comparable_fixed_level"] in (None, 0, 1, 2)
