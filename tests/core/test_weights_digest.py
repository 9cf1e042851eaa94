"""The full-content weights digest (``cachegen.models.weights_digest``) beside the cheap
``fingerprint``: a changed middle tensor, and the per-file digest cache. Hub snapshots (blobs
named by their SHA-256, revisions): tests/connector/test_model_keys.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from cachegen import models
from cachegen.store.keys import chunk_keys

MIB = 1 << 20


@pytest.fixture
def digest_cache(tmp_path, monkeypatch) -> Path:
    """An empty cache root for the digest cache (the models keep their own directories)."""
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "cache-root"))
    return models.digest_cache_path()


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """Each weight or config file whose bytes ``weights_digest`` reads, in order."""
    seen: list[Path] = []
    real = models._sha256_file

    def counted(path: Path) -> str:
        seen.append(path)
        return real(path)

    monkeypatch.setattr(models, "_sha256_file", counted)
    return seen


def _copy_model(spec: models.ModelSpec, to: Path) -> Path:
    """The files of ``spec`` that name its weights: config.json and the weight files."""
    to.mkdir(parents=True)
    for file in [spec.path / "config.json", *models.weight_files(spec.path)]:
        shutil.copy2(file, to / file.name)
    return to


def _middle_tensor(path: Path) -> str:
    """The name of a tensor whose bytes lie more than 1 MiB from both ends of the file."""
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    base, size = 8 + length, path.stat().st_size
    for name, info in header.items():
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            if base + begin > MIB and base + end < size - MIB:
                return name
    raise AssertionError(f"{path} has no tensor away from its first and last MiB")


def change_middle_tensor(path: Path) -> str:
    """Add 1 to the first element of a middle tensor of the safetensors file ``path``, with
    the safetensors library (same names, shapes, dtypes and metadata); its name."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    name = _middle_tensor(path)
    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(path))
    tensors[name].view(-1)[0] += 1
    save_file(tensors, str(path), metadata=metadata)
    return name


def test_a_changed_middle_tensor_keeps_the_fingerprint_but_not_the_digest_or_keys(
    tiny_llama, tmp_path, digest_cache
):
    """A retrained checkpoint written over the same files with unchanged first and last MiB:
    ``fingerprint`` (what shipped calibrations are matched by) cannot tell, the weights digest
    and so every chunk key can."""
    before = _copy_model(tiny_llama, tmp_path / "before")
    after = _copy_model(tiny_llama, tmp_path / "after")
    weights = after / "model.safetensors"
    head, tail = weights.read_bytes()[:MIB], weights.read_bytes()[-MIB:]
    change_middle_tensor(weights)
    assert weights.read_bytes()[:MIB] == head and weights.read_bytes()[-MIB:] == tail

    assert models.fingerprint(after) == models.fingerprint(before)
    assert models.weights_digest(before) == models.weights_digest(tiny_llama.path)  # by content
    assert models.weights_digest(after) != models.weights_digest(before)
    old, new = models.resolve(str(before)), models.resolve(str(after))
    assert old.identity().fingerprint == new.identity().fingerprint
    ids = list(range(3, 3 + 512))
    old_keys = chunk_keys(old.identity(), "p", ids, 256, weights=old.served_weights())
    new_keys = chunk_keys(old.identity(), "p", ids, 256, weights=new.served_weights())
    assert not set(old_keys) & set(new_keys)


def test_the_digest_cache_is_used_while_size_and_mtime_hold_and_refreshed_when_not(
    tmp_path, digest_cache, reads
):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    first = models.weights_digest(model)
    assert sorted(p.name for p in reads) == ["config.json", "model.safetensors"]
    doc = json.loads(digest_cache.read_text())
    assert (doc["schema"], doc["version"]) == (models.DIGEST_CACHE_SCHEMA, 1)
    entry = doc["files"][str(weights.resolve())]
    assert entry["sha256"] == hashlib.sha256(b"a" * 4096).hexdigest()

    reads.clear()
    assert models.weights_digest(model) == first and reads == []  # nothing read again

    # The cache is what is trusted while (size, mtime_ns) hold: other bytes with the same size
    # and mtime are not read (what a retrained checkpoint never has: writing it sets mtime).
    stat = weights.stat()
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert models.weights_digest(model) == first and reads == []

    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a new mtime: read again
    second = models.weights_digest(model)
    assert second != first and [p.name for p in reads] == ["model.safetensors"]
    reads.clear()
    weights.write_bytes(b"b" * 4097)  # another size
    third = models.weights_digest(model)
    assert third not in (first, second) and [p.name for p in reads] == ["model.safetensors"]

    # A corrupt cache is ignored (every file read) and written afresh.
    digest_cache.write_text('{"schema": "cachegen-weights-digests", "ver')
    reads.clear()
    assert models.weights_digest(model) == third and len(reads) == 2
    assert str(weights.resolve()) in json.loads(digest_cache.read_text())["files"]
    # So is a cache of another version, or with a malformed entry.
    for doc in (
        {"schema": models.DIGEST_CACHE_SCHEMA, "version": 99, "files": {}},
        {
            "schema": models.DIGEST_CACHE_SCHEMA,
            "version": 1,
            "files": {str(weights.resolve()): {"size": "4097", "sha256": "ab"}},
        },
    ):
        digest_cache.write_text(json.dumps(doc))
        reads.clear()
        assert models.weights_digest(model) == third and "model.safetensors" in [
            p.name for p in reads
        ]
