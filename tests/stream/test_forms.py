"""The fastest-form controller: its choice among stored forms under a quality bound (its load of
real KV over a socket: tests/lab/network/test_forms_over_link.py)."""

from __future__ import annotations

import pytest

from cachegen.errors import InputError
from cachegen.store import RecordAddress
from cachegen.stream import RECOMPUTE, FastestController, Option

N = 10
TOKENS = [100] * N


def records(name: str, form: str) -> list[RecordAddress]:
    """Chunk ``i``'s record of the option ``name``, stored in ``form``."""
    return [RecordAddress.of(f"{name}/c{i}", form) for i in range(N)]


def option(name: str, size: int, loss: float | None, form: str | None = None) -> Option:
    return Option(name, records(name, form or name), [size] * N, loss)


CODED = option("cachegen-4", 100_000, 1.0)
PACKED = option("cachegen-4-packed", 300_000, 1.0)
INT8 = option("int8", 400_000, 0.1)
COARSE = option("cachegen-9", 50_000, 10.0)
DECODE = {"cachegen-4": 1e-3, "cachegen-4-packed": 1e-4, "int8": 2e-4, "cachegen-9": 1e-3}


def make(options, bound=1.0, prefill_tps=100.0, decode=DECODE, **kw) -> FastestController:
    return FastestController(
        options,
        TOKENS,
        max_loss_pct=bound,
        prefill_tokens_per_s=prefill_tps,
        decode_s_per_token=decode,
        **kw,
    )


def test_a_faster_allowed_form_wins():
    c = make([CODED, PACKED, INT8])
    c.observe_throughput(1_000_000_000, 1.0)  # 1 GB/s: decoding decides
    assert c.choose(0, 0.0) == "cachegen-4-packed"  # 1000 tokens decode in 0.1 s, coded in 1 s
    slow = make([CODED, PACKED, INT8])
    slow.observe_throughput(1_000_000, 1.0)  # 1 MB/s: the bytes decide
    assert slow.choose(0, 0.0) == "cachegen-4"
    # 1 MB in 1 s, then the last chunk's 0.1 s of decoding
    assert slow.decisions[0].predicted_s == pytest.approx(1.1)
    ignored = RecordAddress.of("other/c3", "cachegen-4")
    assert slow.record(3, "int8", ignored) == RecordAddress.of("int8/c3", "int8")
    assert slow.record(3, "cachegen-4-packed", ignored) == RecordAddress.of(
        "cachegen-4-packed/c3", "cachegen-4-packed"
    )


def test_a_form_the_host_receives_slowly_is_priced_at_its_ceiling():
    """On a link faster than the host, a big form arrives at the host's ceiling for it."""
    raw = option("raw", 1_000_000, 0.0)
    fast_decode = {"raw": 1e-5, "int8": 1e-4}
    link_only = make([raw, INT8], decode=fast_decode, initial_mbps=80_000)  # 10 GB/s
    assert link_only.choose(0, 0.0) == "raw"  # 10 MB at 10 GB/s beats int8's decoding
    capped = make([raw, INT8], decode=fast_decode, initial_mbps=80_000, host_mbps={"raw": 800})
    assert capped.choose(0, 0.0) == "int8"
    # raw at its 100 MB/s ceiling: 0.1 s for the 10 MB, then its last chunk's decoding
    raw_s = capped.estimate(0, "raw")
    assert raw_s == pytest.approx(0.1 + 100 * 1e-5)
    assert capped.decisions[0].predicted_s < raw_s
    # a form without a ceiling (its loads so far were bound by their links) moves at the link's
    unbounded = make([raw, INT8], decode=fast_decode, initial_mbps=80_000, host_mbps={"int8": 8})
    fresh = make([raw, INT8], decode=fast_decode, initial_mbps=80_000)
    assert unbounded.estimate(0, "raw") == pytest.approx(fresh.estimate(0, "raw"))
    with pytest.raises(InputError, match="host_mbps"):
        make([raw, INT8], host_mbps={"raw": 0})


def test_a_lossier_faster_form_is_not_chosen():
    cases = ((1.0, ["cachegen-4"]), (10.0, ["cachegen-9", "cachegen-4"]))
    for bound, allowed in cases:
        c = make([CODED, COARSE, option("loss-unknown", 1, None, "fp8")], bound=bound)
        assert c.allowed == allowed  # smallest first; an unknown loss is never allowed
        assert c.choose(0, 0.0) == allowed[0]  # no rate yet: the smallest allowed form
        c.observe_throughput(1_000_000, 1.0)  # the bytes decide: cachegen-9 has half of them
        assert c.choose(1, 0.0) == allowed[0]
    with pytest.raises(InputError, match="no option has a loss of at most 0.01%"):
        make([CODED, COARSE], bound=0.01)


def test_decode_speed_learning_changes_the_choice():
    c = make([CODED, PACKED], decode={"cachegen-4": 1e-5, "cachegen-4-packed": 1e-4})
    c.observe_throughput(1_000_000_000, 1.0)
    assert c.choose(0, 0.0) == "cachegen-4"  # the prior says coded decodes fastest
    c.observe_decode(0, 0.1)  # measured: 1e-3 s/token, ten times the packed form's prior
    assert c.decode_spt["cachegen-4"] == pytest.approx((1e-5 + 1e-3) / 2)  # blended (EWMA)
    assert c.choose(1, 0.0) == "cachegen-4-packed"


def test_a_close_form_is_tried_once_and_its_measurement_decides():
    priors = {"cachegen-4": 1e-3, "cachegen-4-packed": 1e-4, "int8": 1.2e-4}
    c = make([CODED, PACKED, INT8], decode=priors)
    c.observe_throughput(1_000_000_000, 1.0)
    assert c.choose(0, 0.0) == "cachegen-4-packed"  # 0.1 s; int8 0.12 s, coded 1 s
    assert c.choose(1, 0.0) == "cachegen-4-packed"  # nothing measured yet: no trial
    c.observe_decode(0, 0.01)  # packed measured as its prior said
    assert c.choose(2, 0.0) == "int8"  # within 25% of the fastest and never measured: tried
    assert c.choose(3, 0.0) == "cachegen-4-packed"  # int8 waits for the decoder: not again
    c.observe_decode(1, 0.01)
    c.observe_decode(2, 0.005)  # int8 measured: half its prior
    assert c.choose(4, 0.0) == "int8"
    never = make([CODED, PACKED, INT8], decode=priors, explore=0.0)
    never.observe_throughput(1_000_000_000, 1.0)
    never.choose(0, 0.0)
    never.observe_decode(0, 0.01)
    assert never.choose(1, 0.0) == "cachegen-4-packed"


def test_a_chunk_keeps_its_form_unless_another_is_clearly_faster():
    """Mixing two forms puts one's transfer and the other's decoding on the same cores, which
    the prediction does not see: a switch must be predicted ``switch_margin`` faster."""
    priors = {"cachegen-4-packed": 1e-4, "int8": 1.05e-4}

    def after_first_chunk(decode_s: float, **kw) -> str:
        c = make([PACKED, INT8], decode=priors, explore=0.0, **kw)
        c.observe_throughput(1_000_000_000, 1.0)  # 1 GB/s: decoding decides
        assert c.choose(0, 0.0) == "cachegen-4-packed"
        c.observe_decode(0, decode_s)  # blended with the prior: (1e-4 + sample) / 2
        return c.choose(1, 0.0)

    assert after_first_chunk(0.0114) == "cachegen-4-packed"  # int8 now 3% faster: kept
    assert after_first_chunk(0.0114, switch_margin=0.0) == "int8"
    assert after_first_chunk(0.02) == "int8"  # int8 now 30% faster: switched
    with pytest.raises(InputError, match="switch_margin"):
        make([PACKED, INT8], switch_margin=-0.1)


def test_recompute_when_loading_cannot_win():
    c = make([CODED, PACKED], prefill_tps=100_000.0)
    c.observe_throughput(10_000, 1.0)  # 10 kB/s: 1 MB takes 100 s, the text 0.01 s
    assert c.choose(0, 0.0) == RECOMPUTE
    fast = make([CODED, PACKED], prefill_tps=100_000.0)
    fast.observe_throughput(1_000_000_000, 1.0)  # packed: 0.1 s; recompute: 0.01 s
    assert fast.choose(0, 0.0) == RECOMPUTE
    slow_text = make([CODED, PACKED])  # recompute: 10 s
    slow_text.observe_throughput(1_000_000_000, 1.0)
    assert slow_text.choose(0, 0.0) == "cachegen-4-packed"


def test_the_rate_weighs_each_sample_by_its_time():
    """Bytes that waited in socket buffers arrive at memory speed; they must not pass for the
    link's rate."""
    c = make([CODED, PACKED])
    c.observe_throughput(1_000_000, 1.0)  # 8 Mbit/s
    c.observe_throughput(1_000_000, 0.001)  # read from a buffer: 8 Gbit/s
    assert c.estimate_mbps == pytest.approx(2_000_000 * 8 / 1.001 / 1e6)


def test_each_option_moves_at_its_own_measured_rate():
    """Where the host bounds the transfer, a big form's chunks arrive slower than a small
    one's; once an option has been measured its own rate predicts its transfer."""
    c = make([CODED, INT8], decode={"cachegen-4": 2e-5, "int8": 1e-6})
    c.observe_throughput(400_000_000, 1.0)  # 400 MB/s: int8 (4 MB) 10 ms, coded decodes 20 ms
    assert c.choose(0, 0.0) == "int8"
    c.observe_throughput(400_000, 0.04, 0)  # int8's chunk 0 came at 10 MB/s
    # int8: 3.6 MB at 10 MB/s is 0.36 s; coded still moves at the link's rate: 18 ms decoding
    assert c.choose(1, 0.0) == "cachegen-4"


def test_options_are_checked():
    with pytest.raises(InputError, match="distinct"):
        make([CODED, CODED])
    with pytest.raises(InputError, match="records"):
        make([Option("int8", records("int8", "int8")[:1], [1] * N, 0.0)])
