"""``ChunkTransport``: the connector's parts for one engine and model, in one object.

An engine splits them by role: vLLM's scheduler builds a ``StoreIndex`` and plans each
request's load from it (``cachegen.connector.load_plan``); each worker runs those plans
(``cachegen.connector.loader``) and writes saves (``cachegen.connector.writer``). This class
composes all of them over one store, for tools, tests and the lab, which find, load and save
prefixes outside vLLM.

Modes map onto codecs: ``raw``, ``int8``, ``fp8``, ``cachegen`` and ``tcq`` are codecs of the
same names, ``adaptive`` streams the ``cachegen`` codec's levels under a time budget
(``slo_ms``), or with ``max_loss_pct`` every stored form within that quality bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cachegen.connector.codecs import CodecSet
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.index import KeyChain, StoreIndex, open_engine_store
from cachegen.connector.ladder import LevelPolicy
from cachegen.connector.load_plan import plan_load
from cachegen.connector.loader import Loader, LoadResult
from cachegen.connector.parts import RecordParts
from cachegen.connector.save_plan import SavePrefix, SaveRecord
from cachegen.connector.sources import DirectSources, SourcePool
from cachegen.connector.writer import ChunkWriter
from cachegen.kv import KVCache, ModelIdentity
from cachegen.models import ModelSpec, ServedWeights
from cachegen.modes import Form


@dataclass
class EngineStore:
    """What both roles of an engine build over its store: the codecs, the ladder of forms,
    the chunk parts and the key chain."""

    store: Any
    codecs: CodecSet
    ladder: LevelPolicy
    parts: RecordParts
    keys: KeyChain

    @classmethod
    def open(
        cls,
        config: ConnectorConfig,
        spec: ModelSpec,
        identity: ModelIdentity,
        weights: ServedWeights | None = None,
    ) -> EngineStore:
        """``weights``: what the engine serves of ``spec`` (``ServedWeights.of_engine``);
        None: ``spec`` served as it is (its keys are those of ``cachegen store put``)."""
        if weights is None:
            weights = spec.served_weights()
        store = open_engine_store(config)
        codecs = CodecSet(store, config, spec, identity)
        return cls(
            store,
            codecs,
            LevelPolicy(codecs, config, identity.fingerprint),
            RecordParts.of(spec, config.chunk_tokens),
            KeyChain(codecs, identity, config.chunk_tokens, weights),
        )

    def index(self) -> StoreIndex:
        return StoreIndex(self.store, self.keys, self.ladder, self.parts)

    def writer(self) -> ChunkWriter:
        return ChunkWriter(self.store, self.codecs, self.keys, self.ladder, self.parts)

    def loader(
        self, identity: ModelIdentity, sources: SourcePool, config: ConnectorConfig
    ) -> Loader:
        return Loader(
            self.store,
            sources,
            self.parts,
            identity,
            config.prefill_tokens_per_s,
            config.load_timeout_s,
        )

    def close(self) -> None:
        self.codecs.close()
        self.store.close()


class ChunkTransport:
    """Finds, loads and saves the chunks of prompts in the connector's store."""

    def __init__(
        self,
        config: ConnectorConfig,
        spec: ModelSpec,
        identity: ModelIdentity,
        sources: Callable[[Any], SourcePool] = DirectSources,  # where loads read the store
    ) -> None:
        self.config = config
        self.spec = spec
        self.identity = identity
        self.chunk_tokens = config.chunk_tokens
        self.engine_store = EngineStore.open(config, spec, identity)
        self.store = self.engine_store.store
        self.codecs = self.engine_store.codecs
        self.ladder = self.engine_store.ladder
        self.parts = self.engine_store.parts
        self.index = self.engine_store.index()
        self.writer = self.engine_store.writer()
        self.loader = self.engine_store.loader(identity, sources(self.store), config)

    @property
    def history(self) -> Any:
        return self.loader.history

    # ---- codecs, keys, forms ----------------------------------------------------------------

    def codec(self, mode: str) -> Any:
        return self.codecs.get(mode)

    @property
    def profile_choice(self) -> dict[str, Any] | None:
        """Where the cachegen profile came from (``ProfileChoice.to_dict``), once its codec
        is made."""
        return self.codecs.profile_choice

    def forms(self, mode: str) -> list[Form]:
        return self.ladder.forms(mode)

    def load_forms(self, options: RequestOptions) -> list[Form]:
        return self.ladder.load_forms(options)

    def keys(self, mode: str, token_ids: Sequence[int], salt: str | None = None) -> list[str]:
        return self.index.keys(mode, token_ids, salt)

    # ---- lookups -------------------------------------------------------------------------------

    def stored_chunks(self, token_ids: Sequence[int], options: RequestOptions) -> int:
        return self.index.stored_chunks(token_ids, options)

    def loadable_tokens(
        self,
        token_ids: Sequence[int],
        options: RequestOptions,
        begin: int = 0,
        limit: int | None = None,
    ) -> int:
        return self.index.loadable_tokens(token_ids, options, begin, limit)

    def saved_chunks(
        self, token_ids: Sequence[int], modes: Sequence[str], salt: str | None = None
    ) -> int:
        return self.index.saved_chunks(token_ids, modes, salt)

    # ---- load and save --------------------------------------------------------------------------

    def load(
        self,
        token_ids: Sequence[int],
        first_chunk: int,
        num_chunks: int,
        options: RequestOptions,
        on_chunk: Callable[[KVCache], None],
        prefill_tokens_per_s: float | None = None,
        end: int | None = None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> LoadResult:
        """Plan and run a load of chunks ``first_chunk .. first_chunk + num_chunks - 1`` of
        ``token_ids`` (``end``, default the end of the last chunk: where the loaded prefix
        ends), handing each decoded record to ``on_chunk`` (``Loader.run``)."""
        C = self.chunk_tokens
        end = (first_chunk + num_chunks) * C if end is None else end
        plan = plan_load(
            self.index, list(token_ids), first_chunk * C, end, options, self.config.max_load_bytes
        )
        return self.loader.run(plan, on_chunk, prefill_tokens_per_s, out_dtype)

    def save_records(self, prefix: SavePrefix, kv: KVCache) -> list[SaveRecord]:
        return self.writer.save_records(prefix, kv)

    def write(self, record: SaveRecord) -> int:
        return self.writer.write(record)

    def save(
        self,
        token_ids: Sequence[int],
        kv: KVCache,
        modes: Sequence[str],
        sliding_from: int = 0,
        salt: str | None = None,
    ) -> int:
        """``ChunkWriter.save`` of ``kv``, a chunk-aligned slice of the prompt ``token_ids``,
        in every form a save of ``modes`` writes, in the key scope ``salt``."""
        return self.writer.save(SavePrefix(token_ids, modes, sliding_from, salt), kv)

    def close(self) -> None:
        self.loader.close()
        self.engine_store.close()
