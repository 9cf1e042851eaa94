"""Chunks of real serialized KV in a directory store: what the loader's tests load, directly
(tests/stream) or over an emulated link (tests/lab/network)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cachegen.modes import CACHEGEN, Form
from cachegen.store import RecordAddress, open_store

LEVELS = (0, 1, 2)
N_CHUNKS = 12
TOKENS = 16


def kv_blob(seed: int, level: int) -> bytes:
    """A real serialized KV chunk (safetensors, bf16); higher levels are bigger, as in a codec."""
    g = torch.Generator().manual_seed(seed * 10 + level)
    shape = (2, 1 + level, TOKENS, 64)
    return st_save(
        {
            "keys": torch.randn(shape, generator=g).bfloat16(),
            "values": torch.randn(shape, generator=g).bfloat16(),
        }
    )


def records(keys, levels) -> list[RecordAddress]:
    """The records of ``keys`` at ``levels`` (one for all, or one per key): the fixtures store
    level ``lv`` as the form ``cachegen-<lv>``."""
    per_key = [levels] * len(keys) if isinstance(levels, int) else list(levels)
    return [RecordAddress.of(key, form(lv)) for key, lv in zip(keys, per_key, strict=True)]


def form(level: int) -> Form:
    return Form(CACHEGEN, level)


def label(level: int) -> str:
    return form(level).label


def decode(blob: bytes) -> dict:
    return st_load(blob)


@pytest.fixture
def chunks():
    return {(i, lv): kv_blob(i, lv) for i in range(N_CHUNKS) for lv in LEVELS}


@pytest.fixture
def local_store(tmp_path, chunks):
    s = open_store((tmp_path / "store").as_uri())
    keys = [f"ns/chunk{i:03d}" for i in range(N_CHUNKS)]
    for (i, lv), blob in chunks.items():
        s.put(keys[i], lv, blob)
    s.keys = keys
    return s


def collect():
    got: list = []
    return got, lambda i, kv: got.append((i, kv))


def same_kv(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
