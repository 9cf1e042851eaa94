"""The KV container: layout checks, slicing, bit-exact save/load, and corrupt files."""

from __future__ import annotations

import json

import pytest
import torch

from cachegen.errors import KVError
from cachegen.kv import META_FILE, TENSOR_FILE, KVCache, ModelIdentity

IDENTITY = ModelIdentity(name="m", fingerprint="f" * 64, num_layers=3, num_kv_heads=2, head_dim=8)


def make_kv(tokens: int = 10, model: ModelIdentity = IDENTITY, seed: int = 0) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    shape = (model.num_layers, model.num_kv_heads, tokens, model.head_dim)
    return KVCache(
        keys=torch.randn(shape, generator=gen).to(torch.bfloat16),
        values=torch.randn(shape, generator=gen).to(torch.bfloat16),
        token_ids=torch.arange(tokens, dtype=torch.int64) + 100,
        model=model,
    )


def test_geometry_must_match_model():
    kv = make_kv()
    with pytest.raises(KVError, match="does not match"):
        KVCache(kv.keys[:2], kv.values[:2], kv.token_ids, IDENTITY)
    with pytest.raises(KVError, match="token ids"):
        KVCache(kv.keys, kv.values, kv.token_ids[:3], IDENTITY)


def test_slices_know_their_position_and_concat_back():
    kv = make_kv(10)
    parts = kv.chunks(4)
    assert [p.num_tokens for p in parts] == [4, 4, 2]
    assert [p.start for p in parts] == [0, 4, 8]
    assert torch.equal(parts[1].keys, kv.keys[:, :, 4:8])
    joined = KVCache.concat(parts)
    assert torch.equal(joined.keys, kv.keys) and torch.equal(joined.values, kv.values)
    assert torch.equal(joined.token_ids, kv.token_ids)
    with pytest.raises(KVError):
        KVCache.concat([parts[0], parts[2]])
    with pytest.raises(KVError):
        kv.slice(5, 11)


def test_save_load_is_bit_exact(tmp_path):
    kv = make_kv(17).slice(3, 17)
    kv.save(tmp_path / "kv")
    back = KVCache.load(tmp_path / "kv", expect_model=IDENTITY)
    assert back.dtype == torch.bfloat16
    assert torch.equal(back.keys, kv.keys) and torch.equal(back.values, kv.values)
    assert torch.equal(back.token_ids, kv.token_ids)
    assert back.start == 3 and back.model == IDENTITY


def test_save_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "other").write_text("x")
    with pytest.raises(KVError, match="not empty"):
        make_kv().save(tmp_path / "kv")


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_tensor_file_is_rejected(tmp_path, damage):
    path = make_kv().save(tmp_path / "kv") / TENSOR_FILE
    blob = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        blob[len(blob) - 5] ^= 0xFF
        path.write_bytes(blob)
    else:
        path.unlink()
    with pytest.raises(KVError):
        KVCache.load(tmp_path / "kv")


def test_garbage_metadata_is_rejected(tmp_path):
    directory = make_kv().save(tmp_path / "kv")
    (directory / META_FILE).write_text("{not json")
    with pytest.raises(KVError, match="not valid JSON"):
        KVCache.load(directory)
    (directory / META_FILE).write_text(json.dumps({"format": "cachegen-kv", "version": 99}))
    with pytest.raises(KVError, match="version"):
        KVCache.load(directory)
    (directory / META_FILE).write_text(json.dumps({"schema": "cachegen-kv", "version": 3}))
    with pytest.raises(KVError, match="reads version 2"):
        KVCache.load(directory)


def test_metadata_is_versioned_and_version_1_still_loads(tmp_path):
    kv = make_kv()
    directory = kv.save(tmp_path / "kv")
    meta = json.loads((directory / META_FILE).read_text())
    assert list(meta)[:2] == ["schema", "version"] and meta["version"] == 2
    old = {"format": meta.pop("schema"), **meta, "version": 1}  # what version 1 wrote
    (directory / META_FILE).write_text(json.dumps(old))
    again = KVCache.load(directory)
    assert torch.equal(again.keys, kv.keys) and again.model == kv.model


def test_kv_of_another_model_is_rejected(tmp_path):
    other = ModelIdentity(name="m", fingerprint="0" * 64, num_layers=3, num_kv_heads=2, head_dim=8)
    make_kv(model=other).save(tmp_path / "kv")
    with pytest.raises(KVError, match="not m"):
        KVCache.load(tmp_path / "kv", expect_model=IDENTITY)
