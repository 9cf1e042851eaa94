"""``CacheGenConnector``: vLLM's KV-connector API wired to the scheduler and worker sides.

vLLM builds one instance per role: the scheduler's (lookup and planning, ``SchedulerSide``)
and each worker's (moving KV in and out of the paged cache, ``WorkerSide``). This class only
routes vLLM's calls to the right side.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from cachegen import models
from cachegen.connector.checks import check_kv_cache_config, check_model
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.head_shards import HeadExchange, tensor_parallel_shard
from cachegen.connector.metadata import LoadReports, StepMetadata
from cachegen.connector.paged_cache import cache_groups
from cachegen.connector.scheduler import SchedulerSide
from cachegen.connector.sources import DirectSources, SourcePool
from cachegen.connector.stats import CacheGenPromMetrics, CacheGenStats
from cachegen.connector.transport import EngineStore
from cachegen.connector.worker import WorkerSide
from cachegen.models import ModelSpec, ServedWeights

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def contained(fallback: Any = None) -> Callable[[Callable], Callable]:
    """A hook vLLM calls that no exception leaves: one is logged with its traceback, counted
    in ``/metrics`` (``hook_errors``, by hook), and the hook answers ``fallback`` (called with
    the hook's arguments when callable): what vLLM is told when the connector has nothing."""

    def wrap(hook: Callable) -> Callable:
        @functools.wraps(hook)
        def run(self: CacheGenConnector, *args: Any, **kwargs: Any) -> Any:
            try:
                return hook(self, *args, **kwargs)
            except Exception:  # noqa: BLE001 - a connector fault must never stop the engine
                logger.exception("cachegen connector: %s failed", hook.__name__)
                side = self._worker if self._worker is not None else self._scheduler
                if side is not None:
                    side.stats.count("hook_errors", hook.__name__)
                return fallback(*args, **kwargs) if callable(fallback) else fallback

        return run

    return wrap


def served_model(model: Any, download_dir: str | None = None) -> ModelSpec:
    """The spec of the model vLLM serves, from its ``model_config`` (or a model path): a hub
    model at the revision vLLM loaded (``model_config.revision``) from its ``download_dir``; a
    cachegen-built model keeps its short name, so its chunks are shared with offline tools
    (``cachegen encode``/``store``) that name it so."""
    name, revision = (model, None) if isinstance(model, str) else (model.model, model.revision)
    path = Path(name).expanduser()
    if path.is_dir():
        resolved = path.resolve()
        for known in models.known_names():
            if (models.models_dir() / known).resolve() == resolved:
                return models.resolve(known)
    return models.resolve(name, revision=revision, cache_dir=download_dir)


class CacheGenConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores prompt prefixes' KV (compressed by the cachegen codec) and loads it back, in one
    KV cache group or in the several of vLLM's hybrid KV cache manager.

    A subclass may declare more request options (``options_type``) and read the store through
    other sources (:meth:`source_pool`): the lab's connector emulates links so. A server uses
    this class, whose requests choose only among what its engine stores."""

    options_type: type[RequestOptions] = RequestOptions

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No (vLLM 0.33 on asks): a background load may still be writing into the KV cache
        that sleep releases."""
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ConnectorError(
                "the cachegen connector stores every layer of a chunk together, and with "
                "pipeline parallelism each stage holds some layers only: set "
                "pipeline_parallel_size=1 (tensor_parallel_size may be any that divides or "
                "is a multiple of the model's KV heads)"
            )
        if transfer.kv_load_failure_policy != "recompute":
            logger.warning(
                "cachegen connector: kv_load_failure_policy=%r makes a failed KV load fail the "
                "request; set kv_load_failure_policy='recompute' to have vLLM recompute those "
                "tokens instead",
                transfer.kv_load_failure_policy,
            )
        # Before the store is opened: a model or configuration the connector cannot serve
        # stops start-up, and nothing is stored for it (cachegen/connector/checks.py).
        check_kv_cache_config(kv_cache_config)
        model_config = vllm_config.model_config
        spec = served_model(model_config, vllm_config.load_config.download_dir)
        windows = check_model(spec.config, spec.name)
        identity = spec.identity()
        weights = ServedWeights.of_engine(spec, model_config)  # in every chunk key
        # Options a deployment leaves out take the served model's defaults (its mode: tcq
        # where the model ships a tcq calibration), the same in every role.
        self.config = self.read_config(dict(transfer.kv_connector_extra_config or {}), identity)
        block_size = vllm_config.cache_config.block_size
        groups = cache_groups(kv_cache_config, block_size)
        if role == KVConnectorRole.SCHEDULER and any(w is not None for w in windows):
            _log_windows(spec.name, windows, len(groups))
        engine_store = EngineStore.open(self.config, spec, identity, weights)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            # The codecs of the engine's mode and saves, made now: a missing profile or model
            # file stops the start, naming the command that makes it (a server never fits
            # one); another mode's codec is made on a request's first use, or refused there.
            engine_store.codecs.resolve({self.config.defaults.mode, *self.config.save_modes})
            self._scheduler = SchedulerSide(
                self.config, engine_store.index(), block_size, transfer.kv_role, groups
            )
        else:
            sources = self.source_pool(engine_store.store)
            self._worker = WorkerSide(
                engine_store.loader(identity, sources, self.config),
                engine_store.writer(),
                engine_store.close,
                identity,
                groups,
                self.config.chunk_tokens,
                save_async=self.config.save_async,
                load_threads=self.config.load_threads,
                windows=windows,
                exchange=HeadExchange(
                    *tensor_parallel_shard(
                        identity.num_kv_heads, vllm_config.parallel_config.tensor_parallel_size
                    )
                ),
            )

    def read_config(self, extra: dict[str, Any], identity: Any) -> ConnectorConfig:
        """The engine's configuration from its ``kv_connector_extra_config``."""
        return ConnectorConfig.from_extra_config(extra, identity, self.options_type)

    def source_pool(self, store: Any) -> SourcePool:
        """Where loads read ``store`` from: the store itself."""
        return DirectSources(store)

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        layers = self._vllm_config.compilation_config.static_forward_context
        self._worker.register(kv_caches, layers)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.step_started()  # called before the forward pass of every step

    @contained()
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self._worker.start_loads(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete inside start_load_kv, before the forward pass

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # the whole prompt is copied out once, in wait_for_save

    @contained()
    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, StepMetadata)
        self._worker.submit_saves(meta)

    @contained((None, None))
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.get_transfer_results(finished_req_ids).finished_recving or None

    @contained(lambda finished_req_ids: KVConnectorTransferResults())
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        meta = self._connector_metadata
        idle = isinstance(meta, StepMetadata) and meta.step_tokens == 0
        done, failed = self._worker.finished_loads(idle)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    @contained(set)
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.block_ids_with_load_errors()

    @contained()
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._worker is not None
        return self._worker.take_reports()

    @contained()
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- metrics (both sides) ------------------------------------------------------------------

    @contained()
    def get_kv_connector_stats(self) -> CacheGenStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return side.stats.take() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CacheGenStats:
        return CacheGenStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls, vllm_config, metric_types, labelnames, per_engine_labelvalues
    ) -> CacheGenPromMetrics:
        return CacheGenPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ------------------------------------------------------------------------

    @contained((0, False))
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.num_new_matched_tokens(request, num_computed_tokens)

    @contained()
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    @contained(lambda scheduler_output: StepMetadata())
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    @contained()
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        reports = connector_output.kv_connector_worker_meta
        self._scheduler.on_worker_output(
            reports if isinstance(reports, LoadReports) else None,
            set(connector_output.finished_recving or ()),
        )

    @contained((False, None))
    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's end of a request for a SupportsHMA connector, with one KV cache group too
        (its ``request_finished`` is then never called)."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)


def _log_windows(model: str, windows: tuple[int | None, ...], num_groups: int) -> None:
    sliding = sorted({w for w in windows if w is not None})
    logger.info(
        "cachegen connector: %s has %d sliding-window layers (window %s) of %d, in %d KV cache "
        "groups (%s); each chunk is stored as two records (full-attention and sliding layers), "
        "and loads fetch the sliding part only within the window (skip_out_of_window)",
        model,
        sum(w is not None for w in windows),
        "/".join(map(str, sliding)),
        len(windows),
        num_groups,
        "sliding layers keep only their window's blocks"
        if num_groups > 1
        else "every layer keeps every token",
    )
