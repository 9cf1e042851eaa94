"""Connector options: one dataclass, filled from ``kv_connector_extra_config`` and overridden
per request from ``kv_transfer_params``.

Engine-wide keys (``kv_connector_extra_config``):
  store           URL of the chunk store (``file:///dir`` or ``redis://host:port/db``, see
                  ``cachegen.store.open_store``); default: the local chunk directory
  chunk_tokens    tokens per stored chunk; a multiple of vLLM's block size (default 256)
  save_modes      modes whose encodings are written after a prefill (default: ``[mode]``;
                  ``cachegen`` and ``adaptive`` write every level in ``cachegen_levels``)
  cachegen_levels the cachegen levels that are stored (default: a save ladder,
                  ``ChunkTransport.default_ladder``: the codec's default level, coded and, when
                  both fit within half of the raw bf16 KV, packed; when ``adaptive`` is in
                  ``save_modes``, then up to two cheaper levels from the model's shipped
                  calibrated levels if it has them, costs in docs/connector.md; a request for
                  a level that is not stored recomputes); a level's packed form
                  is its record tag ``level | 32768`` (``cachegen.codec.packed.record_tag``),
                  stored and requested like a level; ``adaptive`` chooses among the coded
                  calibrated ones of them (all coded ones for a model without a calibration)
  tcq_levels      the levels of the transform codec ``tcq`` that are stored when ``tcq`` is in
                  ``save_modes`` (default: the codec's default level); ``adaptive`` with
                  ``max_loss_pct`` counts them among its forms (``tcq-<L>``)
  shaper          how ``bandwidth_mbps`` is enforced: ``token-bucket`` (default) or ``netns``
  prefill_tokens_per_s  the engine's prefill rate, used by ``adaptive`` to price recomputation
                  (default: measured by the connector on this engine's own prefills)
  load_async      load in a worker thread while vLLM keeps serving other requests (default
                  true); false loads inside the engine step that needs the KV
  save_async      encode and store in a worker thread (default true); false does it inside
                  the engine step that finished the prefill
  save_wait_ms    how long a request whose leading chunks this engine is still saving (first
                  level not stored yet) waits for them before it computes what is not stored
                  (default 2000; 0: never waits)
  tenant          a scope of this engine's chunks (e.g. a customer): part of every chunk key,
                  so engines with different tenants never share a chunk (default: none)
  store_secret    the store's MAC secret: every record written is signed and every record read
                  must verify (default: ``$CACHEGEN_STORE_SECRET``; unset: not signed)
  max_record_bytes  largest record a load reads (default: no cap); larger ones are refused
                  before they are read whole, and the request recomputes
  max_load_bytes  most bytes one request's load may fetch (default: no cap); a larger prefix is
                  recomputed instead
  profile_source  where the cachegen codec profile (levels, tables ids: it names the chunk
                  keys) comes from: ``store`` (default) uses the profile the store has adopted
                  for this model, checked, and publishes and adopts this machine's when it has
                  none; ``local`` uses this machine's own (chunks stored under another profile
                  are then not found)
Per-request keys (also accepted engine-wide as defaults):
  mode            raw | int8 | fp8 | cachegen | tcq | adaptive        (default cachegen)
  level           quality level for ``cachegen`` or ``tcq`` (default: the codec's default
                  level)
  slo_ms          time budget for loading the prefix in ``adaptive`` mode (required there
                  unless ``max_loss_pct`` is set)
  max_loss_pct    with ``adaptive``: load each chunk in the stored form (a cachegen level coded
                  or packed, or another codec of ``save_modes``: int8, fp8, raw, a tcq level) or
                  recompute it,
                  whichever is predicted to finish soonest, among the forms whose quality loss
                  (perplexity change, %; ``cachegen.codec.form_loss``) is at most this; a bound
                  no stored form meets recomputes (default: unset, the ``slo_ms`` rule; when
                  set, ``slo_ms`` is not used)
  bandwidth_mbps  rate limit of the transfer in Mbit/s for experiments (unset: unlimited)
  rtt_ms          added round-trip time of the transfer in ms for experiments (default 0)
  load, save      switch loading / saving off for one request (default true)
  skip_out_of_window  for a model with both full-attention and sliding-window layers, fetch
                  the sliding layers' part only of the chunks within the largest window
                  before the loaded prefix's end (default true); false fetches every part
A request's ``cache_salt`` (vLLM's per-request isolation key) is part of its chunk keys, next to
the engine's ``tenant``: requests with different salts never share a chunk, requests with the
same salt do, and requests without one share only with each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from math import inf
from typing import Any

from cachegen.connector.errors import ConnectorError
from cachegen.constants import CHUNK_TOKENS, RATE_SHAPERS
from cachegen.modes import CONNECTOR_MODES as MODES
from cachegen.store import StoreConfigError, default_store_url, parse_size
from cachegen.store.keys import check_scope_part

PROFILE_SOURCES = ("store", "local")
REQUEST_KEYS = frozenset(
    {
        "mode",
        "level",
        "slo_ms",
        "max_loss_pct",
        "bandwidth_mbps",
        "rtt_ms",
        "load",
        "save",
        "skip_out_of_window",
    }
)
ENGINE_KEYS = REQUEST_KEYS | {
    "store",
    "chunk_tokens",
    "save_modes",
    "cachegen_levels",
    "tcq_levels",
    "shaper",
    "prefill_tokens_per_s",
    "load_async",
    "save_async",
    "save_wait_ms",
    "tenant",
    "store_secret",
    "max_record_bytes",
    "max_load_bytes",
    "profile_source",
}


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks of the connector."""

    mode: str = "cachegen"
    level: int | None = None
    slo_ms: float | None = None
    max_loss_pct: float | None = None
    bandwidth_mbps: float | None = None
    rtt_ms: float = 0.0
    load: bool = True
    save: bool = True
    skip_out_of_window: bool = True
    # The request's key scope (tenant and cache_salt), set by the scheduler, never by a client's
    # kv_transfer_params (not in REQUEST_KEYS).
    salt: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConnectorError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.level is not None and (
            isinstance(self.level, bool) or not isinstance(self.level, int)
        ):
            raise ConnectorError(f"level must be an integer, got {self.level!r}")
        for name in ("slo_ms", "bandwidth_mbps"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ConnectorError(f"{name} must be a positive number, got {value!r}")
        if (
            isinstance(self.rtt_ms, bool)
            or not isinstance(self.rtt_ms, (int, float))
            or self.rtt_ms < 0
        ):
            raise ConnectorError(f"rtt_ms must be a number >= 0, got {self.rtt_ms!r}")
        loss = self.max_loss_pct
        if loss is not None and (
            isinstance(loss, bool) or not isinstance(loss, (int, float)) or not 0 <= loss < inf
        ):
            raise ConnectorError(
                "max_loss_pct must be a number >= 0 (the largest perplexity change in % a "
                f"stored form may have, e.g. 1), got {loss!r}"
            )
        if self.mode == "adaptive" and self.slo_ms is None and loss is None:
            raise ConnectorError(
                "adaptive mode needs slo_ms (the time budget for loading the prefix) or "
                "max_loss_pct (the quality bound of the fastest stored form)"
            )
        for name in ("load", "save", "skip_out_of_window"):
            if not isinstance(getattr(self, name), bool):
                raise ConnectorError(f"{name} must be true or false, got {getattr(self, name)!r}")

    def override(self, params: dict[str, Any] | None) -> RequestOptions:
        """These options with a request's ``kv_transfer_params`` applied on top."""
        if not params:
            return self
        unknown = set(params) - REQUEST_KEYS
        if unknown:
            raise ConnectorError(
                f"unknown kv_transfer_params {sorted(unknown)}; the cachegen connector accepts "
                f"{sorted(REQUEST_KEYS)}"
            )
        return dataclasses.replace(self, **params)


@dataclass(frozen=True)
class ConnectorConfig:
    """Engine-wide connector configuration."""

    store: str = field(default_factory=default_store_url)  # the store package's default directory
    chunk_tokens: int = CHUNK_TOKENS
    save_modes: tuple[str, ...] = ()
    cachegen_levels: tuple[int, ...] | None = None
    tcq_levels: tuple[int, ...] | None = None
    shaper: str = "token-bucket"
    prefill_tokens_per_s: float | None = None
    load_async: bool = True
    save_async: bool = True
    save_wait_ms: float = 2000.0
    tenant: str | None = None
    store_secret: str | None = field(default=None, repr=False)
    max_record_bytes: int | None = None
    max_load_bytes: int | None = None
    profile_source: str = "store"
    defaults: RequestOptions = field(default_factory=RequestOptions)

    def __post_init__(self) -> None:
        if (
            isinstance(self.chunk_tokens, bool)
            or not isinstance(self.chunk_tokens, int)
            or self.chunk_tokens <= 0
        ):
            raise ConnectorError(
                f"chunk_tokens must be a positive integer, got {self.chunk_tokens!r}"
            )
        for mode in self.save_modes:
            if mode not in MODES:
                raise ConnectorError(
                    f"unknown mode {mode!r} in save_modes; choose from {', '.join(MODES)}"
                )
        if self.shaper not in RATE_SHAPERS:
            raise ConnectorError(
                f"unknown shaper {self.shaper!r}; choose one of {', '.join(RATE_SHAPERS)}"
            )
        rate = self.prefill_tokens_per_s
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate <= 0
        ):
            raise ConnectorError(f"prefill_tokens_per_s must be a positive number, got {rate!r}")
        wait = self.save_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or wait < 0:
            raise ConnectorError(f"save_wait_ms must be a number >= 0, got {wait!r}")
        for name in ("cachegen_levels", "tcq_levels"):
            levels = getattr(self, name)
            if levels is not None and (
                not levels
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in levels)
            ):
                raise ConnectorError(f"{name} must be a non-empty list of integers, got {levels!r}")
        for name in ("load_async", "save_async"):
            if not isinstance(getattr(self, name), bool):
                raise ConnectorError(f"{name} must be true or false, got {getattr(self, name)!r}")
        try:
            check_scope_part("tenant", self.tenant)
        except StoreConfigError as exc:
            raise ConnectorError(str(exc)) from None
        if self.store_secret is not None and not isinstance(self.store_secret, str):
            raise ConnectorError("store_secret must be a string")  # never echo a secret
        for name in ("max_record_bytes", "max_load_bytes"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ConnectorError(f"{name} must be a positive number of bytes, got {value!r}")
        if self.profile_source not in PROFILE_SOURCES:
            raise ConnectorError(
                f"profile_source must be one of {', '.join(PROFILE_SOURCES)}, "
                f"got {self.profile_source!r}"
            )
        if not isinstance(self.store, str) or "://" not in self.store:
            raise ConnectorError(
                f"store must be a URL like file:///path or redis://host:port/0, got {self.store!r}"
            )

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        unknown = set(extra) - ENGINE_KEYS
        if unknown:
            raise ConnectorError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                f"the cachegen connector accepts {sorted(ENGINE_KEYS)}"
            )
        defaults = RequestOptions().override(
            {k: extra.pop(k) for k in list(extra) if k in REQUEST_KEYS}
        )
        save_modes = extra.pop("save_modes", None)
        if save_modes is None:
            save_modes = [defaults.mode]
        if isinstance(save_modes, str) or not isinstance(save_modes, (list, tuple)):
            raise ConnectorError(f"save_modes must be a list of modes, got {save_modes!r}")
        kwargs: dict[str, Any] = {"defaults": defaults, "save_modes": tuple(save_modes)}
        for name in ("cachegen_levels", "tcq_levels"):
            levels = extra.pop(name, None)
            if levels is not None:
                if isinstance(levels, (str, int)) or not isinstance(levels, (list, tuple)):
                    raise ConnectorError(f"{name} must be a list of levels, got {levels!r}")
                kwargs[name] = tuple(levels)
        for name in ("max_record_bytes", "max_load_bytes"):
            if isinstance(extra.get(name), str):
                try:
                    extra[name] = parse_size(extra[name])
                except StoreConfigError as exc:
                    raise ConnectorError(f"{name}: {exc}") from None
        kwargs.update(extra)  # the engine-only keys
        return cls(**kwargs)

    def check_block_size(self, block_size: int) -> None:
        if self.chunk_tokens % block_size:
            raise ConnectorError(
                f"chunk_tokens={self.chunk_tokens} is not a multiple of vLLM's block size "
                f"{block_size}; set kv_connector_extra_config chunk_tokens to a multiple of "
                f"{block_size}"
            )
