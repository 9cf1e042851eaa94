"""The transform codecs' shared machinery: quantizers, bit allocation, the PCA basis and its
file (the codecs themselves: tests/codec/test_tcq.py, tests/lab/codecs/)."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch

from cachegen.codec import CodecError
from cachegen.codec.transform import basis as transform
from cachegen.codec.transform import lloyd_max, packing
from cachegen.kv import ModelIdentity


def test_lloyd_max_codebooks_match_the_published_gaussian_quantizers():
    # Max (1960): positive reconstruction levels and MSE of the unit Gaussian
    published = {
        1: ([0.7979], 0.3634),
        2: ([0.4528, 1.510], 0.1175),
        3: ([0.2451, 0.7560, 1.344, 2.152], 0.03454),
    }
    for bits, (levels, mse) in published.items():
        got, thresholds, got_mse = lloyd_max.lloyd_max(bits)
        assert np.allclose(got[len(got) // 2 :], levels, atol=1e-3)
        assert np.allclose(got, -got[::-1]) and len(thresholds) == len(got) - 1
        assert got_mse == pytest.approx(mse, rel=1e-3)
    assert np.all(np.diff(lloyd_max.gaussian_mse()) < 0)


def test_bit_allocation_follows_the_variances_within_the_budget():
    variances = np.array([16.0, 4.0, 1.0, 0.25, 0.0])
    bits = transform.allocate_bits(variances, 9)
    assert bits.sum() == 9 and list(bits) == sorted(bits, reverse=True)
    assert bits[0] > bits[2] and bits[-1] == 0  # no variance: dropped whatever the budget
    assert transform.allocate_bits(variances, 100).tolist() == [8, 8, 8, 8, 0]
    assert transform.allocate_bits(variances, 0).sum() == 0


def test_pca_basis_is_orthonormal_and_sorted():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(500, 6)) @ rng.normal(size=(6, 6)) + 3.0
    mean, components, variances = transform.fit_pca(x)
    assert np.allclose(components @ components.T, np.eye(6), atol=1e-9)
    assert np.all(np.diff(variances) <= 0) and np.allclose(mean, x.mean(axis=0))
    assert np.allclose(((x - mean) @ components.T).var(axis=0), variances)


def test_pack_bits_round_trips_every_width():
    for bits in range(1, 9):
        codes = torch.randint(0, 1 << bits, (37,), dtype=torch.uint8)
        data = packing.pack_bits(codes, bits)
        assert len(data) == packing.packed_size(37, bits)
        assert torch.equal(packing.unpack_bits(data, bits, 37), codes)


def test_basis_levels_read_back_in_numeric_order():
    """The file's canonical JSON sorts level keys as text ("10" before "5"); the allocations
    stay with their levels, and a basis whose levels are not in increasing order is refused."""
    model = ModelIdentity("m", "0" * 64, 1, 1, 2)
    bits = np.array([[[[1, 1]] * 2], [[[8, 8]] * 2]], dtype=np.uint8)  # level 5: 1 bit, 10: 8
    arrays = (
        np.zeros((1, 2, 2), np.float32),
        np.tile(np.eye(2, dtype=np.float32), (1, 2, 1, 1)),
        np.ones((1, 2, 2), np.float32),
        bits,
    )
    basis = transform.TransformBasis(model, {}, (0.0,), {5: 0.5, 10: 8.0}, *arrays)
    again = transform.parse_basis(basis.file_bytes, "test", basis.id)
    assert list(again.levels) == [5, 10]
    assert again.level_bits(5)[0, 0].tolist() == [1, 1]
    assert again.level_bits(10)[0, 0].tolist() == [8, 8]
    with pytest.raises(CodecError, match="increasing order"):
        transform.TransformBasis(model, {}, (0.0,), {10: 8.0, 5: 0.5}, *arrays)


def test_basis_whose_header_is_not_an_object_is_refused():
    data = transform.MAGIC + struct.pack("<I", 2) + b"[]"
    digest = hashlib.sha256(data).hexdigest()[:32]
    with pytest.raises(CodecError):
        transform.parse_basis(data, "test", digest)
