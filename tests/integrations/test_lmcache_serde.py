"""The cachegen serde inside LMCache (0.5.6): LMCache's own StorageManager, built from its own
command-line parser with the adapter of docs/guide/lmcache.md (its file-system L2 adapter,
``"serde": {"type": "cachegen", ...}``), stores SmolLM2's KV through its store controller and
``AsyncSerdeProcessor`` and loads it back through its prefetch controller. What it stores is
our codec's bitstream of the same KV; what it loads is that bitstream decoded; records that are
not the serde's own (another model file, another geometry, damaged, truncated) are refused."""

from __future__ import annotations

import argparse
import json
import re
import time
import zlib
from pathlib import Path

import pytest
import torch

from cachegen.codec import CodecError, decode
from cachegen.codec.coding.bitstream import parse_header
from cachegen.kv import KVCache
from tests.support import REPO

pytest.importorskip("lmcache")

from lmcache.v1.distributed.api import (  # noqa: E402
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402

from cachegen.integrations.lmcache import register  # noqa: E402
from cachegen.integrations.lmcache.records import (  # noqa: E402
    ChunkLayout,
    RecordCodec,
    SerdeOptions,
)
from cachegen.integrations.lmcache.serde import CachegenDeserializer  # noqa: E402

GUIDE = REPO / "docs" / "guide" / "lmcache.md"
ADAPTER_BLOCK = re.compile(r"<!-- adapter -->\n```json\n(.*?)\n```", re.DOTALL)
CHUNK = 256  # LMCache's default chunk_size
HEADS_OFFSET = 12  # num_kv_heads in a header (docs/bitstream.md)
WAIT_S = 600  # the serde's threads share two cores with other tests


def _guide_adapter(base_path: Path) -> dict:
    """The L2 adapter of the guide, with its base_path here."""
    (block,) = ADAPTER_BLOCK.findall(GUIDE.read_text())
    adapter = json.loads(block)
    adapter["base_path"] = str(base_path)
    return adapter


def _lmcache_layout(kv: KVCache) -> torch.Tensor:
    """``kv`` as LMCache holds a chunk: [2, layers, tokens, heads x head_dim]."""
    planes = torch.stack([kv.keys, kv.values]).permute(0, 1, 3, 2, 4)
    return planes.reshape(2, kv.num_layers, kv.num_tokens, -1).contiguous()


@pytest.fixture(scope="module")
def chunks(smollm2) -> list[KVCache]:
    from cachegen import workload
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(smollm2)
    ids = tokenizer(workload.text("eval")[:8000])["input_ids"][: 2 * CHUNK]
    return extract_kv(spec, token_ids=torch.tensor(ids)).chunks(CHUNK)


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """LMCache's StorageManager with the guide's adapter; yields it and its base_path."""
    register()
    base = tmp_path_factory.mktemp("l2")
    parser = argparse.ArgumentParser()
    add_storage_manager_args(parser)
    args = parser.parse_args(
        ["--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--no-l1-use-lazy"]
        + ["--l2-adapter", json.dumps(_guide_adapter(base))]
    )
    config = parse_args_to_config(args)
    config.l1_manager_config.memory_config.shm_name = ""  # no shared memory: one process
    manager = StorageManager(config)
    yield manager, base
    manager.close()


@pytest.fixture(scope="module")
def records() -> RecordCodec:
    (block,) = ADAPTER_BLOCK.findall(GUIDE.read_text())
    serde = dict(json.loads(block)["serde"])
    serde.pop("type")
    return RecordCodec.from_options(SerdeOptions.from_kwargs(serde))


def _key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=bytes([i]) * 16, model_name="smollm2-135m", kv_rank=0)


def _layout(chunk: torch.Tensor) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[chunk.shape], dtypes=[chunk.dtype])


def _store(manager: StorageManager, base: Path, key: ObjectKey, chunk: torch.Tensor) -> Path:
    objs = manager.reserve_write([key], _layout(chunk))
    objs[key].tensor.copy_(chunk)
    manager.finish_write([key])
    deadline = time.monotonic() + WAIT_S
    while not (files := list(base.glob(f"*{key.chunk_hash.hex()}*"))):
        assert time.monotonic() < deadline, "LMCache stored nothing in its L2 adapter"
        time.sleep(0.2)
    manager.delete_l1_keys([key], force=True)
    return files[0]


def _load(manager: StorageManager, key: ObjectKey, chunk: torch.Tensor) -> torch.Tensor | None:
    """The chunk LMCache prefetches from L2 (None: a miss)."""
    row = GroupedObjectKeys(keys=[key], object_group_id=0, layout_desc=_layout(chunk))
    handle = manager.submit_prefetch_task(PrefetchTaskSpec(key_groups=[row]))
    assert manager.wait_prefetch_status(handle, WAIT_S)
    result = manager.query_prefetch_status(handle)
    if result.l2_hit_cells[0].popcount() != 1:
        return None
    with manager.read_prefetched_results([key], result.l1_owners) as objs:
        loaded = objs[0].tensor.clone()
    manager.finish_read_prefetched([key], 1, result.l1_owners)
    manager.delete_l1_keys([key], force=True)
    return loaded


def test_lmcache_stores_our_bitstream_and_loads_its_decoding(storage, records, chunks):
    manager, base = storage
    for i, kv in enumerate(chunks):
        chunk = _lmcache_layout(kv)
        stored = _store(manager, base, _key(i), chunk).read_bytes()
        # The serde sees no tokens nor positions: the stream is the chunk's at start 0.
        unplaced = KVCache(kv.keys, kv.values, torch.zeros(CHUNK, dtype=torch.int64), kv.model)
        blob = records.codec.encode(unplaced, records.level)
        assert stored[: len(blob)] == blob and not any(stored[len(blob) :])
        assert len(stored) == records.record_size(ChunkLayout.of([chunk.shape], [chunk.dtype]))
        loaded = _load(manager, _key(i), chunk)
        assert loaded is not None and torch.equal(loaded, _lmcache_layout(decode(blob)))


def _forged(record: bytes, at: int, new: bytes) -> bytes:
    """``record`` with ``new`` at offset ``at`` of its header, the header's CRC made right."""
    size = parse_header(record).size
    header = bytearray(record[:size])
    header[at : at + len(new)] = new
    header[-4:] = zlib.crc32(header[:-4]).to_bytes(4, "little")
    return bytes(header) + record[size:]


def _deserialize(manager: StorageManager, records: RecordCodec, record: bytes, out_shape) -> None:
    """LMCache memory objects from its L1: ``record`` in one, decoded into the other."""
    src_key, dst_key = _key(200), _key(201)
    src_layout = MemoryLayoutDesc(shapes=[torch.Size([len(record)])], dtypes=[torch.uint8])
    dst_layout = MemoryLayoutDesc(shapes=[torch.Size(out_shape)], dtypes=[torch.bfloat16])
    src = manager.reserve_write([src_key], src_layout)[src_key]
    dst = manager.reserve_write([dst_key], dst_layout)[dst_key]
    try:
        src.tensor.copy_(torch.frombuffer(bytearray(record), dtype=torch.uint8))
        CachegenDeserializer(records).deserialize(src, dst, dst_key)
    finally:
        manager.finish_write([src_key, dst_key])
        manager.delete_l1_keys([src_key, dst_key], force=True)


@pytest.fixture(scope="module")
def stored(storage, chunks) -> tuple[bytes, Path, torch.Tensor]:
    """The record of the first chunk as LMCache stored it, its file and the chunk."""
    manager, base = storage
    chunk = _lmcache_layout(chunks[0])
    path = _store(manager, base, _key(100), chunk)
    return path.read_bytes(), path, chunk


def test_a_record_of_another_model_file_is_refused(storage, records, stored):
    manager, _ = storage
    record, path, chunk = stored
    model_file = bytes.fromhex(records.codec.tcq.id)
    other = _forged(record, record.index(model_file), bytes(16))
    with pytest.raises(CodecError, match="another tcq model file"):
        _deserialize(manager, records, other, chunk.shape)
    path.write_bytes(other)
    assert _load(manager, _key(100), chunk) is None  # LMCache: a miss, nothing loaded


def test_a_record_of_another_geometry_is_refused(storage, records, stored):
    manager, _ = storage
    record, _, chunk = stored
    fewer_tokens = (2, chunk.shape[1], CHUNK // 2, chunk.shape[3])
    with pytest.raises(CodecError, match="not the 128 tokens"):
        _deserialize(manager, records, record, fewer_tokens)
    heads = records.identity.num_kv_heads + 1
    other_heads = _forged(record, HEADS_OFFSET, heads.to_bytes(2, "little"))
    with pytest.raises(CodecError, match="refused before decoding"):
        _deserialize(manager, records, other_heads, chunk.shape)
    another_model = (2, chunk.shape[1] - 1, CHUNK, chunk.shape[3])
    with pytest.raises(CodecError, match="another model, or a tensor-parallel shard"):
        _deserialize(manager, records, record, another_model)


def test_a_damaged_or_truncated_record_is_refused(storage, records, stored):
    manager, _ = storage
    record, path, chunk = stored
    damaged = bytearray(record)
    damaged[len(record.rstrip(b"\0")) - 1] ^= 0xFF  # in the stream's last frame
    with pytest.raises(CodecError):
        _deserialize(manager, records, bytes(damaged), chunk.shape)
    with pytest.raises(CodecError, match="truncated"):
        _deserialize(manager, records, record[: len(record) // 2], chunk.shape)
    cut = record[: len(record) // 2] + bytes(len(record) - len(record) // 2)
    with pytest.raises(CodecError):
        _deserialize(manager, records, cut, chunk.shape)
    path.write_bytes(bytes(damaged))
    assert _load(manager, _key(100), chunk) is None
    path.write_bytes(record[: len(record) // 2])
    assert _load(manager, _key(100), chunk) is None


def test_the_serde_refuses_an_unknown_option_naming_it():
    register()
    register()  # again: a no-op
    config = SerdeConfig(type="cachegen", kwargs={"model": "smollm2-135m", "levle": 22})
    with pytest.raises(CodecError, match="unknown option 'levle'"):
        create_serde_processor(config)
