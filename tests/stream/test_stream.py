"""The loader straight from a store (DirectSource): pipelined fetch+decode, memory bounds, and
the adaptive controller's choices."""

from __future__ import annotations

import time

import pytest

from cachegen.store import RecordAddress, open_store
from cachegen.stream import RECOMPUTE, AdaptiveController, DirectSource, StreamTimeout, stream_load
from cachegen.stream.source import DIRECT_PREFETCH
from tests.stream.chunks_support import N_CHUNKS, collect, decode, label, records, same_kv


def test_per_chunk_levels_and_direct_source(local_store, chunks):
    levels = [i % 3 for i in range(N_CHUNKS)]
    got, consume = collect()
    loads = records(local_store.keys, levels)
    stats = stream_load(DirectSource(local_store), loads, decode, consume)
    assert stats.forms == [label(lv) for lv in levels]
    assert all(same_kv(kv, decode(chunks[(i, levels[i])])) for i, kv in got)


def test_buffer_bounds_memory(local_store):
    """With a slow decoder the fetcher stops after max_buffered chunks (plus one in hand and
    the rest of the store read it came from)."""
    reads = []
    original = local_store.get_records

    def counting_get_records(items):
        reads.extend(key for key, _ in items)
        return original(items)

    local_store.get_records = counting_get_records
    seen = []

    def slow_decode(blob):
        if not seen:
            time.sleep(0.3)  # lets an unbounded fetcher read everything meanwhile
            seen.append(len(reads))
        return len(blob)

    stream_load(
        DirectSource(local_store),
        records(local_store.keys, 0),
        slow_decode,
        lambda i, x: None,
        max_buffered=2,
    )
    # chunk being decoded + buffer + one waiting to be handed over + its read's other chunks
    assert seen[0] <= 1 + 2 + 1 + DIRECT_PREFETCH - 1


# ---- adaptive controller ---------------------------------------------------------------

SIZES = {0: [100_000] * 10, 1: [200_000] * 10, 2: [400_000] * 10}


def make_controller(slo_s, prefill_tps=10_000.0, **kw):
    return AdaptiveController(
        slo_s, SIZES, [100] * 10, prefill_tokens_per_s=prefill_tps, drop_factor=1.0, **kw
    )


def test_controller_picks_best_level_that_fits():
    c = make_controller(1.0, prefill_tps=20_000.0)
    assert c.choose(0, 0.0) == 0  # no throughput known yet: the cheapest level
    c.observe_throughput(10_000_000, 1.0)  # 10 MB/s: chunks 1-9 take 0.09 / 0.18 / 0.36 s
    assert c.choose(1, 0.0) == 2
    assert c.choose(1, 0.75) == 1  # 0.25 s left
    assert c.choose(1, 0.88) == 0  # 0.12 s left
    assert c.choose(1, 0.95) == RECOMPUTE  # 0.05 s left: 900 tokens at 20k tok/s take 0.045 s
    assert [d.choice for d in c.decisions] == [0, 2, 1, 0, RECOMPUTE]
    assert c.decisions[1].predicted_s == pytest.approx(0.36)


def test_controller_orders_levels_by_size_not_by_number():
    """Calibrated levels are numbered after the paper's: level 6 may be coarser than level 4."""
    sizes = {1: [100_000] * 10, 4: [400_000] * 10, 6: [200_000] * 10, 9: [None] * 10}
    c = AdaptiveController(1.0, sizes, [100] * 10, prefill_tokens_per_s=20_000.0, drop_factor=1.0)
    assert c.levels == [1, 6, 4, 9]
    c.observe_throughput(10_000_000, 1.0)
    assert c.choose(1, 0.0) == 4  # the biggest (finest) level that fits
    assert c.choose(1, 0.75) == 6  # 0.25 s left: level 6 (0.18 s) fits, level 4 (0.36 s) does not
    assert c.choose(1, 0.88) == 1


def test_controller_when_nothing_fits():
    c = make_controller(0.5, prefill_tps=100_000.0)
    c.observe_throughput(10_000, 1.0)  # 10 kB/s: 7 chunks at level 0 take 70 s
    assert c.choose(3, 0.1) == RECOMPUTE  # 700 tokens at 100k tok/s take 7 ms
    slow = make_controller(0.5, prefill_tps=1.0)
    slow.observe_throughput(10_000, 1.0)
    assert slow.choose(3, 0.1) == 0  # neither fits: level 0 (70 s) is faster than text (700 s)


def test_controller_accounts_for_decode_time():
    blind = make_controller(1.0)
    aware = make_controller(1.0, decode_s_per_token={0: 1e-6, 1: 2e-3, 2: 4e-3})
    for c in (blind, aware):
        c.observe_throughput(100_000_000, 1.0)  # transfer takes at most 36 ms
    assert blind.choose(1, 0.0) == 2
    assert aware.choose(1, 0.0) == 0  # 900 tokens decode in 1.8 s at level 1, 3.6 s at level 2
    aware.observe_decode(1, 0.0001)  # level 0 measured: the priors of the others are kept
    assert aware.decode_spt == {0: pytest.approx(1e-6), 1: 2e-3, 2: 4e-3}


def test_controller_counts_the_decode_backlog():
    c = make_controller(0.5, decode_s_per_token={0: 1e-4, 1: 2e-4, 2: 4e-4})
    c.observe_throughput(1_000_000_000, 1.0)  # the link is fast; decoding is the bottleneck
    assert [c.choose(i, 0.0) for i in range(3)] == [2, 2, 2]  # 10 x 40 ms = 0.4 s fits
    # Nothing decoded yet: 3 chunks (0.12 s) wait for the decoder, so at 0.2 s only
    # 0.12 + 7 x 20 ms = 0.26 s fits the 0.3 s left, and 0.12 + 7 x 40 ms = 0.40 s does not.
    assert c.choose(3, 0.2) == 1
    for i in range(4):
        c.observe_decode(i, 0.0)  # the decoder caught up (instantly, say)
    assert c.choose(4, 0.2) == 2  # 6 x 40 ms = 0.24 s


def test_recoverability_rule():
    greedy = make_controller(1.0, prefill_tps=1.0)
    careful = AdaptiveController(1.0, SIZES, [100] * 10, prefill_tokens_per_s=1.0, drop_factor=2.0)
    for c in (greedy, careful):
        c.observe_throughput(10_000_000, 1.0)
    # 0.19 s left. Level 1 needs 0.18 s at 10 MB/s. At half the rate, chunk 1 at level 1 plus
    # chunks 2-9 at level 0 need 0.04 + 0.16 = 0.20 s: not recoverable. Level 0: 0.18 s.
    assert greedy.choose(1, 0.81) == 1
    assert careful.choose(1, 0.81) == 0
    assert careful.choose(1, 0.0) == 2  # with room to spare both agree


def test_a_load_past_its_deadline_reads_no_more_from_a_direct_store(tmp_path):
    """DirectSource reads in the fetch thread: once the load's deadline has passed it asks the
    store for nothing more, and the load stops with StreamTimeout and its statistics."""
    store = open_store((tmp_path / "store").as_uri())
    records = [RecordAddress.of(f"ns/chunk{i}", "int8") for i in range(6)]
    for address in records:
        store.write(address, b"x" * 1000)
    consumed = []

    def slow_consume(index, payload):
        consumed.append(index)
        time.sleep(0.2)  # a decoder slower than the deadline allows

    with pytest.raises(StreamTimeout, match="deadline") as late:
        stream_load(DirectSource(store, prefetch=1), records, bytes, slow_consume, timeout_s=0.3)
    assert 0 < late.value.stats.n_loaded < len(records) and consumed == list(range(len(consumed)))
