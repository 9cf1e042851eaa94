"""The ``cachegen`` serde of LMCache's L2 adapters: LMCache's ``Serializer`` and
``Deserializer`` around a :class:`RecordCodec`, run in LMCache's ``AsyncSerdeProcessor``
threads on host memory. Importing this module imports LMCache."""

from __future__ import annotations

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.memory_management import MemoryObj

from cachegen.codec import CodecError
from cachegen.integrations.lmcache.records import ChunkLayout, RecordCodec, SerdeOptions


class CachegenSerializer(Serializer):
    """Encodes a chunk into its record (the key is not used: records describe themselves)."""

    def __init__(self, records: RecordCodec) -> None:
        self.records = records

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        return self.records.encode(_tensor(src, "source"), _tensor(dst, "destination"))

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return self.records.record_size(ChunkLayout.of(layout_desc.shapes, layout_desc.dtypes))


class CachegenDeserializer(Deserializer):
    """Decodes a record into a chunk, refusing records that are not this serde's."""

    def __init__(self, records: RecordCodec) -> None:
        self.records = records

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        record = memoryview(_tensor(src, "source").numpy())
        self.records.decode_into(record, _tensor(dst, "destination"))


def make_processor(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache's serde factory: ``kwargs`` is the adapter's ``"serde"`` dict less ``"type"``."""
    options = SerdeOptions.from_kwargs(kwargs)
    records = RecordCodec.from_options(options)
    return AsyncSerdeProcessor(
        CachegenSerializer(records), CachegenDeserializer(records), options.max_workers
    )


def _tensor(obj: MemoryObj, what: str):
    tensor = obj.tensor
    if tensor is None or tensor.device.type != "cpu":
        raise CodecError(f"cachegen serde: the {what} memory object is not a host tensor")
    return tensor
