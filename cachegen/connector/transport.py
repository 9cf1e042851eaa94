"""The connector's one seam to the rest of the library: find, fetch and write KV chunks.

It composes the codec (``cachegen.codec``: chunk <-> bitstream, per quality level), the store
(``cachegen.store``: chained chunk keys, longest stored prefix, put/get) and the stream
(``cachegen.stream``: rate-limited transfer pipelined with decoding, adaptive level choice).
Modes map onto codecs: ``raw``, ``int8``, ``fp8`` and ``cachegen`` are codecs of the same
names, ``adaptive`` streams the ``cachegen`` codec's levels under the adaptive controller.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.errors import CacheGenError
from cachegen.kv import KVCache, ModelIdentity
from cachegen.models import ModelSpec
from cachegen.store import ChunkCorrupt, chunk_keys, longest_prefix, open_store
from cachegen.stream import AdaptiveController, open_link, stream_load

# A measured goodput is remembered per link and becomes the controller's prior for the next load.
GOODPUT_EWMA = 0.5


@dataclass
class LoadResult:
    """Outcome of fetching chunks: the first ``chunks_loaded`` were injected, the rest were not.

    ``error`` says why the rest were not (a failure, or the adaptive controller choosing to
    recompute); the connector turns it into recomputation of those tokens.
    """

    chunks_loaded: int
    error: str | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class ChunkTransport:
    def __init__(self, config: ConnectorConfig, spec: ModelSpec, identity: ModelIdentity) -> None:
        self.config = config
        self.spec = spec
        self.identity = identity
        self.chunk_tokens = config.chunk_tokens
        try:
            self.store = open_store(config.store)
        except CacheGenError as exc:
            raise ConnectorError(f"cannot open the KV store {config.store!r}: {exc}") from exc
        self._codecs: dict[str, Any] = {}
        self._links: dict[tuple[float | None, float], Any] = {}
        self._goodput_mbps: dict[tuple[float | None, float], float] = {}
        self._exits = contextlib.ExitStack()
        self._lock = threading.Lock()

    # ---- codecs, keys, levels -------------------------------------------------------------------

    def codec(self, mode: str) -> Any:
        name = "cachegen" if mode == "adaptive" else mode
        with self._lock:
            if name not in self._codecs:
                self._codecs[name] = _get_codec(name, self.spec, self.chunk_tokens)
            return self._codecs[name]

    def keys(self, mode: str, token_ids: Sequence[int]) -> list[str]:
        """Keys of the whole chunks of ``token_ids`` under ``mode``'s codec profile."""
        profile = self.codec(mode).profile_id
        return chunk_keys(
            self.identity, profile, list(token_ids), self.chunk_tokens, include_partial=False
        )

    def levels(self, mode: str) -> list[int]:
        """The levels stored for ``mode``: all of the codec's, or ``cachegen_levels``."""
        codec = self.codec(mode)
        chosen = self.config.cachegen_levels if mode in ("cachegen", "adaptive") else None
        if chosen is None:
            return list(codec.levels)
        unknown = sorted(set(chosen) - set(codec.levels))
        if unknown:
            raise ConnectorError(
                f"cachegen_levels {unknown} are not levels of this model's profile "
                f"{list(codec.levels)}"
            )
        return list(chosen)

    @functools.cached_property
    def adaptive_levels(self) -> list[int]:
        """The levels ``adaptive`` chooses from: ``cachegen_levels`` when set, else the model's
        shipped calibrated levels when it has them, else every level.

        The controller ranks levels by their bytes, which only orders quality along a frontier:
        on SmolLM2 the paper's level 3 is slightly larger than calibrated level 4 at several
        times its perplexity change, so with both on offer it sent level 3 (docs/connector.md).
        The calibrated levels were each chosen for a measured perplexity target and together
        dominate the presets (docs/quality.md). Found once per transport: the scheduler asks on
        every lookup, and the shipped calibration is read from files."""
        if self.config.cachegen_levels is None:
            calibrated = self.codec("adaptive").profile.calibrated_levels()
            if calibrated:
                return calibrated
        return self.levels("adaptive")

    def load_levels(self, options: RequestOptions) -> list[int]:
        """Levels a chunk must be stored at to be loadable with ``options``."""
        if options.mode == "adaptive":
            return list(self.adaptive_levels)
        codec = self.codec(options.mode)
        level = codec.default_level if options.level is None else options.level
        if level not in self.levels(options.mode):
            raise ConnectorError(
                f"{options.mode} stores levels {self.levels(options.mode)}, not {level}"
            )
        return [level]

    def stored_chunks(self, token_ids: Sequence[int], options: RequestOptions) -> int:
        """Leading whole chunks of ``token_ids`` loadable with ``options``."""
        return longest_prefix(
            self.store, self.keys(options.mode, token_ids), self.load_levels(options)
        )

    def saved_chunks(self, token_ids: Sequence[int], modes: Sequence[str]) -> int:
        """Leading whole chunks of ``token_ids`` already stored at every level of every mode."""
        counts = [
            longest_prefix(self.store, self.keys(m, token_ids), self.levels(m)) for m in modes
        ]
        return min(counts, default=0)

    # ---- load ----------------------------------------------------------------------------------

    def _link(self, options: RequestOptions) -> Any:
        """The link for ``options``' rate and RTT, started on first use and kept for the next
        loads: its chunk server is a child process (a remote machine's stand-in) whose start-up
        must not be charged to every load's TTFT."""
        key = (options.bandwidth_mbps, float(options.rtt_ms))
        with self._lock:
            if key not in self._links:
                if options.bandwidth_mbps is None and not options.rtt_ms:
                    link = open_link(self.store, shaper="none")
                else:
                    link = open_link(
                        self.store,
                        bandwidth_mbps=options.bandwidth_mbps,
                        rtt_ms=options.rtt_ms,
                        shaper=self.config.shaper,
                    )
                self._links[key] = self._exits.enter_context(link)
            return self._links[key]

    def load(
        self,
        token_ids: Sequence[int],
        first_chunk: int,
        num_chunks: int,
        options: RequestOptions,
        on_chunk: Callable[[KVCache], None],
        prefill_tokens_per_s: float | None = None,
    ) -> LoadResult:
        """Stream chunks ``first_chunk .. first_chunk + num_chunks - 1`` of ``token_ids``,
        decode them and hand each (in order) to ``on_chunk``."""
        C = self.chunk_tokens
        keys = self.keys(options.mode, token_ids[: (first_chunk + num_chunks) * C])[first_chunk:]
        if len(keys) != num_chunks:
            raise ConnectorError(
                f"{len(token_ids)} tokens do not hold chunks "
                f"{first_chunk}..{first_chunk + num_chunks - 1}"
            )
        link_key = (options.bandwidth_mbps, float(options.rtt_ms))

        def consume(index: int, kv: KVCache) -> None:
            start = (first_chunk + index) * C
            expected = torch.as_tensor(token_ids[start : start + C], dtype=torch.int64)
            if kv.start != start or not torch.equal(kv.token_ids, expected):
                raise ConnectorError(
                    f"chunk {first_chunk + index} decodes to tokens of another prefix"
                )
            if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (
                self.identity.num_layers,
                self.identity.num_kv_heads,
                self.identity.head_dim,
            ):
                raise ConnectorError(
                    f"chunk {first_chunk + index} has the KV geometry of another model"
                )
            on_chunk(kv)

        kwargs: dict[str, Any] = {}
        if options.mode == "adaptive":
            assert options.slo_ms is not None
            levels = self.load_levels(options)
            sizes = {lv: self.store.sizes(keys, lv) for lv in levels}
            kwargs["controller"] = AdaptiveController(
                options.slo_ms / 1000.0,
                sizes,
                [C] * num_chunks,
                prefill_tokens_per_s=self.config.prefill_tokens_per_s
                or prefill_tokens_per_s
                or 1000.0,
                initial_mbps=self._goodput_mbps.get(link_key, options.bandwidth_mbps),
            )
        else:
            kwargs["level"] = self.load_levels(options)[0]
        try:
            stats = stream_load(self._link(options).source, keys, _decode, consume, **kwargs)
        except CacheGenError as exc:
            partial = getattr(exc, "stats", None)
            loaded = partial.n_loaded if partial else 0
            if _damaged(exc) and partial is not None and loaded < len(keys):
                self._drop(keys[loaded], partial.levels[loaded])
            return LoadResult(loaded, f"{type(exc).__name__}: {exc}", _report(partial))
        if stats.transfer_s > 0 and stats.bytes:
            previous = self._goodput_mbps.get(link_key)
            now = stats.goodput_mbps
            self._goodput_mbps[link_key] = (
                now if previous is None else (1 - GOODPUT_EWMA) * previous + GOODPUT_EWMA * now
            )
        error = None
        if stats.recompute_from is not None:
            error = (
                f"adaptive controller left chunks from {first_chunk + stats.recompute_from} "
                "on to recomputation"
            )
        return LoadResult(stats.n_loaded, error, _report(stats))

    def _drop(self, key: str, level: Any) -> None:
        """Delete a damaged chunk so that the recomputation that follows stores it afresh."""
        if not isinstance(level, int):
            return
        try:
            self.store.delete(key, level)
        except CacheGenError:
            pass  # the store is failing anyway; the entry stays damaged and keeps being recomputed

    # ---- save ----------------------------------------------------------------------------------

    def save(self, token_ids: Sequence[int], kv: KVCache, modes: Sequence[str]) -> int:
        """Encode and store the whole chunks of ``kv``, a chunk-aligned slice of the prompt
        ``token_ids``, at every level of every mode; chunks already stored are skipped.
        Returns the bytes written."""
        C = self.chunk_tokens
        first = kv.start // C
        written = 0
        for mode in dict.fromkeys("cachegen" if m == "adaptive" else m for m in modes):
            codec = self.codec(mode)
            keys = self.keys(mode, token_ids[: kv.start + kv.num_tokens])[first:]
            for key, chunk in zip(keys, kv.chunks(C)):
                for level in self.levels(mode):
                    if self.store.exists(key, level):
                        continue
                    blob = codec.encode(chunk, level=level)
                    self.store.put(key, level, blob)
                    written += len(blob)
        return written

    def close(self) -> None:
        self._exits.close()
        self.store.close()


def _report(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    return {
        "bytes": stats.bytes,
        "levels": list(stats.levels),
        "transfer_s": stats.transfer_s,
        "decode_s": stats.decode_s,
        "inject_s": stats.consume_s,
        "wait_bytes_s": stats.wait_bytes_s,
        "goodput_mbps": stats.goodput_mbps,
    }


# ---- the codec ---------------------------------------------------------------------------------
# Imported on first use, never at start-up: the codec pulls in numba, and vLLM 0.32's CPU
# start-up crashes when llvmlite is already loaded (see docs/connector.md, "Known issues").


def _get_codec(name: str, spec: ModelSpec, chunk_tokens: int) -> Any:
    from cachegen.profiles import codec_for

    return codec_for(name, spec, chunk_tokens=chunk_tokens)


def _decode(blob: bytes) -> KVCache:
    from cachegen.codec import decode

    return decode(blob)


def _damaged(exc: BaseException) -> bool:
    """Whether ``exc`` means a stored chunk is damaged (as opposed to unreachable)."""
    from cachegen.codec import CodecError

    return isinstance(exc, (ChunkCorrupt, CodecError, ConnectorError))
