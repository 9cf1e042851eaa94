"""The tcq encoder's kernels against plain NumPy: the same symbols, offsets and tables."""

from __future__ import annotations

import numpy as np
import pytest

from cachegen.codec.coding import rans
from cachegen.codec.tcq import kernels as tcq_kernels
from cachegen.codec.tcq.code import OFFSET_UNITS, code_lengths, family_tables


def _numpy_quantize(y: np.ndarray, radius: np.ndarray, centred: bool):
    """What the encoder computed before its kernel: a partition for the lower median, then
    NumPy's rounding (half to even) and clipping."""
    y = y.copy()
    offset = np.zeros(len(radius), dtype=np.float32)
    if centred and y.shape[1]:
        middle = (y.shape[1] - 1) // 2
        median = np.partition(y, middle, axis=1)[:, middle]
        offset = np.clip(np.round(median * OFFSET_UNITS), -127, 127)
        y -= (offset / OFFSET_UNITS)[:, None]
    r = radius.astype(np.float32)[:, None]
    sym = (np.clip(np.round(y), -r, r) + r).astype(np.uint8)
    return sym, offset.astype(np.int8), y


def _kernel_quantize(y: np.ndarray, radius: np.ndarray, centred: bool):
    y = y.copy()
    sym = np.empty(y.shape, dtype=np.uint8)
    offset = np.empty(len(radius), dtype=np.int8)
    tcq_kernels.quantize_coefficients(y, radius, centred, OFFSET_UNITS, sym, offset)
    return sym, offset, y


def _coefficients(seed: int, components: int, tokens: int) -> np.ndarray:
    """Coefficients in steps with what rounding and medians find hard: halves (ties), values
    on both sides of the offsets' +-127 quarter steps, spreads far past the radii."""
    rng = np.random.default_rng(seed)
    centre = rng.choice([0.0, 0.375, -5.125, 31.8, -40.0, 80.0], size=(components, 1))
    spread = rng.choice([0.3, 2.0, 60.0], size=(components, 1))
    y = centre + spread * rng.standard_normal((components, tokens))
    halves = rng.random((components, tokens)) < 0.2
    y[halves] = np.round(y[halves] * 2) / 2  # exact halves and integers
    return y.astype(np.float32)


@pytest.mark.parametrize("tokens", [0, 1, 2, 7, 256])
@pytest.mark.parametrize("centred", [False, True])
def test_quantize_kernel_is_numpys_median_rounding_and_clipping(tokens, centred):
    y = _coefficients(tokens, 40, tokens)
    radius = np.random.default_rng(1).integers(1, 128, size=40).astype(np.int64)
    expected = _numpy_quantize(y, radius, centred)
    got = _kernel_quantize(y, radius, centred)
    for want, have in zip(expected, got):
        np.testing.assert_array_equal(have, want)


def test_offsets_reach_both_clips():
    y = np.array([[-50.0] * 5, [50.0] * 5, [-31.75] * 5], dtype=np.float32)
    _, offset, _ = _kernel_quantize(y, np.array([3, 3, 3]), True)
    assert offset.tolist() == [-127, 127, -127]


def _family_code_bits(radius: int, family_size: int):
    """Code lengths of random calibrated tables of ``radius``, then a family's."""
    rng = np.random.default_rng(radius)
    n = 2 * radius + 1
    family = rng.integers(1, 1000, size=(family_size, radius + 1))
    own = rans.quantize_frequencies(rng.integers(0, 50, size=(6, n)) + 1, np.full(6, n))
    freq = np.concatenate([own, family_tables(family, radius)])
    return code_lengths(rans.pack_freq_cum(freq.astype(np.uint16)))


def _numpy_choice(sym, rows, first, family_size, code_bits):
    choice = np.zeros(len(sym), dtype=np.uint8)
    for c, row in enumerate(sym):
        counts = np.bincount(row, minlength=code_bits.shape[1]).astype(np.float64)
        costs = [counts @ code_bits[rows[c]]]
        costs += [counts @ code_bits[first + j] for j in range(family_size)]
        best = int(np.argmin(costs))  # the first of the cheapest
        choice[c] = best if costs[best] < costs[0] else 0
    return choice


def test_table_choice_is_the_cheapest_over_the_whole_alphabet():
    radius, family_size = 9, 5
    code_bits = _family_code_bits(radius, family_size)
    rng = np.random.default_rng(3)
    sym = np.clip(np.round(rng.laplace(radius, rng.uniform(0.3, 4, (6, 1)), (6, 300))), 0, 18)
    sym = sym.astype(np.uint8)
    rows = np.arange(6, dtype=np.int64)
    family_bits = np.ascontiguousarray(code_bits[6:, : 2 * radius + 1].T)
    family_start = np.full(128, -1, dtype=np.int64)
    family_start[radius] = 0
    choice = np.empty(6, dtype=np.uint8)
    tcq_kernels.choose_tables(
        sym, np.full(6, radius), rows, code_bits, family_bits, family_start, choice
    )
    expected = _numpy_choice(sym, rows, 6, family_size, code_bits)
    np.testing.assert_array_equal(choice, expected)
    assert len(set(choice.tolist())) > 1  # the data exercised both kinds of table
