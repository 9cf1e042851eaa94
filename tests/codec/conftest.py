"""Fixtures of the transform codecs' tests (test_transform.py, test_tcq.py): a profile
directory of each module's own, and tiny-llama's KV of a short text."""

from __future__ import annotations

import pytest

from cachegen.kv import KVCache
from tests.codec.transform_support import TEXT, own_profile_dir


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """A profile directory of the module's own (its basis or model file is fitted once into
    it)."""
    with own_profile_dir(tmp_path_factory.mktemp("profiles")) as path:
        yield path


@pytest.fixture(scope="module")
def kv(tiny_llama) -> KVCache:
    from cachegen.extract import extract_kv

    return extract_kv(tiny_llama, text=TEXT)


SMALL_FIT_TOKENS = 1024  # the recipe fits on 4,096 calibration tokens


@pytest.fixture(scope="session")
def small_fits_dir(tmp_path_factory, gemma3):
    """A copy of this machine's profile directory (Gemma's cachegen profile built first, as
    any Gemma test needs it) in which kvtc bases and tcq model files are fitted on fewer
    calibration tokens than the recipe's, once per test run."""
    import shutil

    from cachegen.codec.coding.tables import profiles_dir
    from cachegen.profiles import ensure_profile

    ensure_profile(gemma3)
    path = tmp_path_factory.mktemp("small-fits") / "profiles"
    shutil.copytree(profiles_dir(), path)
    return path


@pytest.fixture
def small_fits(small_fits_dir, monkeypatch):
    """For tests that need *a* kvtc basis or tcq model file of a real model, not a good one:
    fitting those of Gemma 3 by the recipe takes minutes on 2 cores without bf16
    instructions. The user's profile directory is left alone."""
    from cachegen.fitting import kvtc, sensitivity

    monkeypatch.setattr(kvtc, "KVTC_CALIBRATION_TOKENS", SMALL_FIT_TOKENS)
    monkeypatch.setattr(sensitivity, "SENSITIVITY_WINDOWS", 1)
    monkeypatch.setattr(sensitivity, "SENSITIVITY_CONTEXT", SMALL_FIT_TOKENS // 4)
    monkeypatch.setattr(sensitivity, "SENSITIVITY_SCORED", 16)  # Gemma's logits are 262K wide
    with own_profile_dir(small_fits_dir):
        yield small_fits_dir
