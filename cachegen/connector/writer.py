"""The worker's saves: the records a save of a prompt writes, each encoded and stored."""

from __future__ import annotations

from typing import Any

from cachegen.connector.codecs import CodecSet
from cachegen.connector.index import KeyChain
from cachegen.connector.ladder import LevelPolicy
from cachegen.connector.parts import RecordParts
from cachegen.connector.save_plan import ModeLadder, SavePrefix, SaveRecord, plan_save
from cachegen.kv import KVCache
from cachegen.modes import CODED


class ChunkWriter:
    """Encodes and stores the chunks of saved prompts, in every form their modes store."""

    def __init__(
        self,
        store: Any,
        codecs: CodecSet,
        keys: KeyChain,
        ladder: LevelPolicy,
        parts: RecordParts,
    ) -> None:
        self.store = store
        self.codecs = codecs
        self.keys = keys
        self.ladder = ladder
        self.parts = parts

    def save_records(self, prefix: SavePrefix, kv: KVCache) -> list[SaveRecord]:
        """The records :meth:`save` writes of ``kv``, a chunk-aligned slice of the prompt of
        ``prefix``, in the order it writes them (``cachegen.connector.save_plan.plan_save``)."""
        C = self.parts.chunk_tokens
        first = kv.start // C
        tokens = prefix.token_ids[: kv.start + kv.num_tokens]
        firsts = self.ladder.first_forms(prefix.modes)
        ladders = [
            ModeLadder(
                self.keys.keys(codec, tokens, prefix.salt)[first:], forms, firsts.get(codec, [])
            )
            for codec, forms in self.ladder.stored_forms(prefix.modes).items()
        ]
        return plan_save(kv, ladders, self.parts, prefix.sliding_from)

    def write(self, record: SaveRecord) -> int:
        """Encode and store one record unless it is already stored; returns the bytes written."""
        if self.store.holds([record.address])[0]:
            return 0
        form = record.address.form
        codec = self.codecs.get(form.codec)
        if form.packing == CODED:
            blob = codec.encode(record.kv, level=form.level)
        else:
            blob = codec.encode(record.kv, level=form.level, form=form.packing)
        self.codecs.publish_tables(form.codec)
        self.store.write(record.address, blob)
        return len(blob)

    def save(self, prefix: SavePrefix, kv: KVCache) -> int:
        """Encode and store the whole chunks of ``kv``, a chunk-aligned slice of the prompt of
        ``prefix``, in every form a save of its modes writes; records already stored are
        skipped. For a model with sliding-window layers each chunk is two records
        (``RecordParts.part_records``); chunks before ``prefix.sliding_from`` get no sliding
        part (their sliding layers' KV in ``kv`` is not valid: a load skipped it). Returns the
        bytes written."""
        return sum(self.write(record) for record in self.save_records(prefix, kv))
