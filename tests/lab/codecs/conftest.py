"""Fixtures of the research codecs' tests: tiny-llama's KV of a short text."""

from __future__ import annotations

import pytest

from cachegen.kv import KVCache
from tests.codec.transform_support import TEXT


@pytest.fixture(scope="module")
def kv(tiny_llama) -> KVCache:
    from cachegen.extract import extract_kv

    return extract_kv(tiny_llama, text=TEXT)
