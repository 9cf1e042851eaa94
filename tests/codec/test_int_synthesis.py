"""tcq's integer synthesis (cachegen.codec.tcq.int_synthesis, the kernel of synthesis.c): the
kernel's sums are exact in each of its loops (AVX2's and, where the CPU has it,
AVX512-VNNI's), its matrices round within their bound, and a decode through it stays within
that bound of the model file's arithmetic, in every output dtype."""

from __future__ import annotations

import dataclasses
import platform
import shutil

import numpy as np
import pytest
import torch

from cachegen.codec import decode
from cachegen.codec.tcq import code as tcq_code
from cachegen.codec.tcq import decode as tcq_decode
from cachegen.codec.tcq import int_synthesis
from cachegen.codec.tcq.int_synthesis import MAX_COEFFICIENT, IntegerSynthesis
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen.profiles import codec_for
from tests.codec.test_tcq import BY_STEP, reference_decode

needs_kernel = pytest.mark.skipif(
    not int_synthesis.available(),
    reason="the int16 kernel is not here: the package was installed without a C compiler, "
    "or the CPU has no AVX2 (the decoder then keeps the float32 product, tested in test_tcq.py)",
)


@pytest.fixture(scope="module")
def model_file(tiny_llama, profiles):
    return ensure_tcq_model(tiny_llama)


def _matrices(streams: int, width: int, channels: int, kept: list[int]) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    synthesis = torch.randn((streams, width, channels), generator=generator)
    for s, rows in enumerate(kept):
        synthesis[s, rows:] = 0
    return synthesis


def test_matrices_round_within_half_a_scale_and_no_sum_can_overflow():
    synthesis = _matrices(3, 600, 32, [600, 100, 0])
    matrices = IntegerSynthesis.of(synthesis)
    entries = matrices.entries().astype(np.float64)
    scale = matrices.scale.astype(np.float64)
    error = np.abs(entries * scale[:, None, :] - synthesis.numpy())
    assert np.all(error <= 0.5 * scale[:, None, :] * (1 + 1e-6))
    worst = MAX_COEFFICIENT * np.abs(entries).sum(axis=1)  # every coefficient at its bound
    assert worst.max() <= 2**31 - 1
    assert np.abs(entries[0]).max() < 32767  # over 516 rows int32 binds, not int16
    assert np.abs(entries[1]).max() == 32767 and not entries[2].any()


def _kernel_case(
    tokens: int,
    turned: bool,
    bf16: bool,
    shifted: bool = False,
    loops: str | None = None,
    refinements: int_synthesis.Refinements | None = None,
    cos_rows: int | None = None,
):
    """Random int16 coefficients of 4 streams (one not asked for), 3 heads of 16 channels,
    through the kernel (its ``loops``, default the CPU's fastest) into a [streams, heads,
    tokens, head_dim] output, the means moved by random offsets if ``shifted``, its
    ``refinements`` added if given (keys turned from angle row 3 of ``cos_rows`` rows,
    default all they need); with the exact float32 arithmetic it should do, written
    plainly."""
    streams, width, heads, head_dim = 4, 194, 3, 16
    channels, half = heads * head_dim, head_dim // 2
    matrices = IntegerSynthesis.of(_matrices(streams, width, channels, [194, 7, 194, 0]))
    rng = np.random.default_rng(tokens)
    coefficients = rng.integers(-127, 128, (streams, tokens, width)).astype(np.int16)
    mean = rng.normal(size=(streams, channels)).astype(np.float32)
    angles = rng.uniform(0, 6.3, (cos_rows or tokens + 3, head_dim)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    first = np.array([3 if turned else -1, -1, 0 if turned else -1, -1], dtype=np.int64)
    size = streams * heads * tokens * head_dim
    out = np.full(size, 0x7FC0 if bf16 else np.nan, np.uint16 if bf16 else np.float32)
    base = np.arange(streams, dtype=np.int64) * heads * tokens * head_dim
    to = int_synthesis.Destination(out, base, tokens, head_dim, cos, sin, first)
    todo = np.array([3, 0, 1])
    offsets = rng.integers(-127, 128, (streams, width)).astype(np.int16)
    moved = np.full_like(mean, np.nan)
    shift = int_synthesis.Shift(offsets, 0.25, moved) if shifted else None
    int_synthesis.product(coefficients, matrices, mean, to, shift, loops, refinements)(todo)
    entries = matrices.entries()
    sums = np.einsum("stw,swc->stc", coefficients.astype(np.int64), entries.astype(np.int64))
    if shifted:
        moves = np.einsum("sw,swc->sc", offsets.astype(np.int64), entries.astype(np.int64))
        mean = mean + moves.astype(np.float32) * matrices.scale * np.float32(0.25)
        np.testing.assert_array_equal(moved[todo], mean[todo])
    x = sums.astype(np.float32) * matrices.scale[:, None, :] + mean[:, None, :]
    x = x.reshape(streams, tokens, heads, head_dim).transpose(0, 2, 1, 3).astype(np.float64)
    want = x.copy()
    for k in np.flatnonzero(first >= 0):
        c, s = cos[first[k] : first[k] + tokens], sin[first[k] : first[k] + tokens]
        x1, x2 = x[k][..., :half], x[k][..., half:]
        want[k][..., :half] = -x2 * s[:, :half] + (x1 * c[:, :half]).astype(np.float32)
        want[k][..., half:] = x1 * s[:, half:] + (x2 * c[:, half:]).astype(np.float32)
    got = out.reshape(streams, heads, tokens, head_dim)
    if bf16:
        got = torch.from_numpy(got.astype(np.int32) << 16).view(torch.float32).numpy()
    want = _written(want.astype(np.float32), bf16)
    if refinements is not None:
        fine = (entries, matrices.scale, cos, sin, first)
        want = _refined(want, refinements, fine, (heads, head_dim), bf16)
    return todo, got, want


def _written(rows: np.ndarray, bf16: bool) -> np.ndarray:
    """float32 ``rows`` as the kernel stores them: rounded to bfloat16 if ``bf16``."""
    if not bf16:
        return rows
    return torch.from_numpy(rows).to(torch.bfloat16).float().numpy()


def _refined(want, fine: int_synthesis.Refinements, matrices, shape, bf16) -> np.ndarray:
    """``want`` [streams, heads, tokens, head_dim] with ``fine``'s rows added as the kernel
    adds them: each row's exact sums times its scale and unit, turned as the stream's rows,
    added to the row as stored, stored again."""
    entries, scale, cos, sin, first = matrices
    heads, head_dim = shape
    half, want = head_dim // 2, want.copy()
    stream = np.repeat(np.arange(len(fine.start) - 1), np.diff(fine.start))
    for j, (k, t) in enumerate(zip(stream, fine.tokens)):
        sums = fine.rows[j].astype(np.int64) @ entries[k].astype(np.int64)
        x = (sums.astype(np.float32) * scale[k] * np.float32(fine.unit)).astype(np.float64)
        x = x.reshape(heads, head_dim)
        if first[k] >= 0:
            c, s = cos[first[k] + t], sin[first[k] + t]
            x1, x2 = x[:, :half].copy(), x[:, half:].copy()
            x[:, :half] = -x2 * s[:half] + (x1 * c[:half]).astype(np.float32)
            x[:, half:] = x1 * s[half:] + (x2 * c[half:]).astype(np.float32)
        want[k, :, t] = _written(want[k, :, t] + x.astype(np.float32), bf16)
    return want


def _runs_here(loops: str) -> str:
    if loops not in int_synthesis.loops_here():
        pytest.skip(f"this CPU does not run the kernel's {loops} loops (it has no AVX512-VNNI)")
    return loops


LOOPS = pytest.mark.parametrize("loops", [int_synthesis.AVX2_LOOPS, int_synthesis.VNNI_LOOPS])


@needs_kernel
@LOOPS
@pytest.mark.parametrize("tokens", [1, 5, 13, 256])
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_kernel_sums_exactly_then_adds_the_means(tokens, bf16, loops):
    todo, got, want = _kernel_case(tokens, turned=False, bf16=bf16, loops=_runs_here(loops))
    np.testing.assert_array_equal(got[todo], want[todo])  # int32 exact, then float32 ops
    assert np.isnan(got[2]).all()  # a stream not asked for is not written


@needs_kernel
@LOOPS
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_kernel_moves_the_means_by_the_offsets_exactly(bf16, loops):
    # the offsets' sums are exact in int32 too, then scaled in float32
    todo, got, want = _kernel_case(
        5, turned=False, bf16=bf16, shifted=True, loops=_runs_here(loops)
    )
    np.testing.assert_array_equal(got[todo], want[todo])
    assert not np.array_equal(got[0], _kernel_case(5, turned=False, bf16=bf16)[1][0])


def _refinements(
    tokens: int, counts=(9, 2, 1, 0), bound: int = 2, unit: float = 0.25
) -> int_synthesis.Refinements:
    """Random refinements (within ``bound``, in ``unit``) of ``_kernel_case``'s 4 streams:
    ``counts[k]`` distinct tokens of stream ``k`` (9: a whole tile of the VNNI loops and one
    row more)."""
    rng = np.random.default_rng(7)
    rows = rng.integers(-bound, bound + 1, (sum(counts), 194)).astype(np.int16)
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    picks = [np.sort(rng.choice(tokens, count, replace=False)) for count in counts]
    return int_synthesis.Refinements(rows, start, np.concatenate(picks).astype(np.int64), unit)


@needs_kernel
@LOOPS
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_kernel_adds_refined_rows_to_the_rows_it_wrote(bf16, loops):
    # each refined row: its exact sums, scaled, a quarter of them added to the stored row
    fine = _refinements(13)
    todo, got, want = _kernel_case(13, False, bf16, loops=_runs_here(loops), refinements=fine)
    np.testing.assert_array_equal(got[todo], want[todo])
    _, plain, _ = _kernel_case(13, False, bf16, loops=loops)
    changed = np.any(got[todo] != plain[todo], axis=(1, 3))  # [todo, tokens]
    stream = np.repeat(np.arange(4), np.diff(fine.start))
    refined = np.zeros((4, 13), dtype=bool)
    refined[stream, fine.tokens] = True
    np.testing.assert_array_equal(changed, refined[todo])
    assert np.isnan(got[2]).all()  # stream 2, not asked for, is neither written nor refined


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_kernel_turns_refined_rows_as_it_turns_keys(bf16):
    # corrections as large as the rows, so that one left unturned shows in bfloat16 too
    fine = _refinements(13, bound=MAX_COEFFICIENT, unit=1.0)
    todo, got, want = _kernel_case(13, True, bf16, refinements=fine)
    ulp = 2.0**-8 if bf16 else 2.0**-23
    largest = float(np.abs(want[todo]).max())
    np.testing.assert_allclose(got[todo], want[todo], rtol=ulp, atol=4 * ulp * largest)


@needs_kernel
@pytest.mark.parametrize(
    "bad, match",
    [
        ({"tokens": np.array([0, 1, 2, 13], np.int64)}, "refined token"),
        ({"tokens": np.array([0, 1, 2, -1], np.int64)}, "refined token"),
        ({"start": np.array([0, 3, 1, 4, 4], np.int64)}, "out of order"),
        ({"start": np.array([0, 1, 2, 3, 3], np.int64)}, "out of order"),
        ({"rows": np.full((4, 194), 128, np.int16)}, "beyond"),
        ({"rows": np.zeros((4, 194), np.int32)}, "refinements of"),
    ],
)
def test_the_kernel_refuses_refinements_it_cannot_add(bad, match):
    # the kernel writes where the tokens say: every index is checked before it runs
    fine = int_synthesis.Refinements(
        np.zeros((4, 194), np.int16),
        np.array([0, 1, 2, 3, 4], np.int64),
        np.array([0, 1, 2, 3], np.int64),
        0.25,
    )
    with pytest.raises(ValueError, match=match):
        _kernel_case(13, False, False, refinements=dataclasses.replace(fine, **bad))


@needs_kernel
def test_the_kernel_refuses_angles_past_its_cos_and_sin_rows():
    # keys turned from angle row first_angle + t: the rows must be there for every token
    with pytest.raises(ValueError, match="angles"):
        _kernel_case(14, True, False, cos_rows=14 + 2)


@needs_kernel
def test_the_kernel_refuses_offsets_past_the_coefficients_bound():
    # an offset of -128 (a corrupt frame; encoders clip to 127) could overflow the sums
    streams, width, channels = 1, 4, 16
    matrices = IntegerSynthesis.of(_matrices(streams, width, channels, [width]))
    mean = np.zeros((streams, channels), np.float32)
    offsets = np.full((streams, width), -128, np.int16)
    shift = int_synthesis.Shift(offsets, 0.25, mean.copy())
    angles = np.zeros((0, 0), np.float32)
    out = np.zeros(channels, np.float32)
    to = int_synthesis.Destination(
        out, np.zeros(1, np.int64), 1, 16, angles, angles, -np.ones(1, np.int64)
    )
    coefficients = np.zeros((streams, 1, width), np.int16)
    with pytest.raises(ValueError, match="offsets"):
        int_synthesis.product(coefficients, matrices, mean, to, shift)


@needs_kernel
@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_the_kernel_turns_keys_as_the_row_writer_does(bf16):
    # two fused multiply-adds per pair of channels (qkernels.store_row): the float64
    # reference rounds the sum once more, so at most one float32 ulp of the operands apart
    # (bf16: a tie rounded the other way)
    todo, got, want = _kernel_case(9, turned=True, bf16=bf16)
    ulp = 2.0**-8 if bf16 else 2.0**-23
    largest = float(np.abs(want[todo]).max())
    np.testing.assert_allclose(got[todo], want[todo], rtol=ulp, atol=2 * ulp * largest)
    assert not np.array_equal(got[0], _kernel_case(9, turned=False, bf16=bf16)[1][0])


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not torch.backends.cpu.get_cpu_capability().startswith("AVX"),
    reason="the kernel is for x86-64 CPUs with AVX2",
)
def test_the_kernel_is_built_where_a_compiler_is():
    # setup.py builds it optionally (a machine without a C compiler still installs), so a
    # broken build would only show as a slower decode
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the package installs without the kernel")
    assert int_synthesis.available(), "reinstall: pip install --no-deps -e . (see setup.py)"


def test_the_kernel_takes_even_widths_and_head_dims_of_whole_vectors():
    assert int_synthesis.fits(192, 64) and int_synthesis.fits(2, 16)
    assert not int_synthesis.fits(191, 64) and not int_synthesis.fits(192, 24)


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decoder_stays_within_the_integer_synthesis_bound(
    kv, tiny_llama, model_file, out_dtype, monkeypatch
):
    # each synthesis entry is off by at most half its scale, so a row by at most half the
    # scale times the sum of the token's coefficient magnitudes; keys mix a pair of channels
    # by their rotation; then the output's rounding and the float32 differences.
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: False)
    monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda: True)
    level = BY_STEP[1]
    codec = codec_for("tcq", tiny_llama, chunk_tokens=64)
    out = decode(codec.encode(kv, level), out_dtype)
    got = torch.stack([out.keys, out.values])[:, :, :, 1:].float()
    ref = reference_decode(model_file, kv, level, 64)
    sums = reference_decode(model_file, kv, level, 64, sums=True)
    L, H, _, D = kv.keys.shape
    layers = tuple(range(L))
    tables = tcq_code.level_code(model_file, level).stream_tables(model_file, layers)
    scale = torch.from_numpy(tables.integer_synthesis.scale).view(L, 2, H, D).transpose(0, 1)
    bound = 0.5 * scale[:, :, :, None, :] * sums
    half = D // 2
    bound[0] = bound[0] + torch.cat([bound[0][..., half:], bound[0][..., :half]], dim=-1)
    ulp = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    bound = bound + ulp * ref.abs() + 1e-5 * float(ref.abs().max())
    excess = float(((got - ref).abs() - bound).max())
    assert excess <= 0, f"an element is {excess:.3g} beyond the integer synthesis's bound"


@needs_kernel
def test_decoders_pick_the_integer_product_unless_the_cpu_has_amx(monkeypatch):
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: False)
    assert tcq_decode.synthesis_arithmetic(torch.bfloat16, 192, 64) == tcq_decode.INT16
    assert tcq_decode.synthesis_arithmetic(torch.float32, 192, 64) == tcq_decode.INT16
    assert tcq_decode.synthesis_arithmetic(torch.float32, 191, 64) == tcq_decode.FLOAT32
    # AVX512-BF16 without AMX: the integer product measured faster than the bf16 GEMM
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: True)
    monkeypatch.setattr(tcq_decode, "amx_synthesis", lambda: False)
    assert tcq_decode.synthesis_arithmetic(torch.bfloat16, 192, 64) == tcq_decode.INT16
    assert tcq_decode.synthesis_arithmetic(torch.bfloat16, 191, 64) == tcq_decode.BF16
    monkeypatch.setattr(tcq_decode, "amx_synthesis", lambda: True)
    assert tcq_decode.synthesis_arithmetic(torch.bfloat16, 192, 64) == tcq_decode.BF16
    assert tcq_decode.synthesis_arithmetic(torch.float32, 192, 64) == tcq_decode.INT16


@needs_kernel
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_frames_decode_alike_in_one_hand_out_one_each_or_unfused(
    kv, tiny_llama, model_file, out_dtype, monkeypatch
):
    # the fused decoder hands a few frames' streams to the threads at once, each frame in its
    # own scratch; one frame per hand-out, or the symbols' and products' passes apart, must
    # give the same bits
    monkeypatch.setattr(tcq_decode, "bf16_synthesis", lambda: False)
    monkeypatch.setattr(tcq_decode, "int16_synthesis", lambda: True)
    blob = codec_for("tcq", tiny_llama, chunk_tokens=16).encode(kv, BY_STEP[1])
    together = decode(blob, out_dtype)
    monkeypatch.setattr(tcq_decode, "_HANDOUT_SCRATCH", 1)
    one_each = decode(blob, out_dtype)
    monkeypatch.setattr(tcq_decode.TcqDecoder, "_fused", lambda self, arithmetic: False)
    unfused = decode(blob, out_dtype)
    for other in (one_each, unfused):
        assert torch.equal(together.keys, other.keys)
        assert torch.equal(together.values, other.values)
