"""Connector options: one dataclass each for the engine (``kv_connector_extra_config``) and a
request (``kv_transfer_params``, whose keys in ``kv_connector_extra_config`` set the engine's
defaults).

Each option is declared once, as a field made by ``option``: its scope, default (or the
model's, ``model_default``), check and a one-line doc; the key sets, the validation and
``describe_options()`` are read from the declarations, and a test checks docs/connector.md's
"Options" tables against them. A request's
``cache_salt`` (vLLM's isolation key) and the engine's ``tenant`` are part of its chunk keys
(docs/security.md); a client cannot set the key scope through ``kv_transfer_params``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from math import inf
from typing import Any

from cachegen.connector.errors import ConnectorError
from cachegen.connector.link_emulation import link_opener
from cachegen.constants import CHUNK_TOKENS, RATE_SHAPERS
from cachegen.kv import ModelIdentity
from cachegen.modes import CACHEGEN, TCQ
from cachegen.modes import CONNECTOR_MODES as MODES
from cachegen.store import StoreConfigError, default_store_url, parse_size
from cachegen.store.keys import check_scope_part

PROFILE_SOURCES = ("store", "local")
REQUEST, ENGINE = "request", "engine"  # request options are also the engine's defaults
Check = Callable[[str, Any], None]


def option(
    scope: str,
    doc: str,
    check: Check,
    default: Any = None,
    model_default: Callable[[ModelIdentity], Any] | None = None,
    **kwargs: Any,
) -> Any:
    """A connector option's declaration: a dataclass field that knows its scope, check and doc;
    ``model_default``: the default for an engine of a model (``default`` without one)."""
    metadata = {"scope": scope, "doc": doc, "check": check}
    if model_default is not None:
        metadata["model_default"] = model_default
    if "default_factory" in kwargs:
        return field(metadata=metadata, **kwargs)
    return field(default=default, metadata=metadata, **kwargs)


# ---- checks: each raises ConnectorError naming the option ---------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_number(name: str, value: Any) -> None:
    if value is not None and (not _is_number(value) or value <= 0):
        raise ConnectorError(f"{name} must be a positive number, got {value!r}")


def non_negative_number(name: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise ConnectorError(f"{name} must be a number >= 0, got {value!r}")


def loss_bound(name: str, value: Any) -> None:
    if value is not None and (not _is_number(value) or not 0 <= value < inf):
        raise ConnectorError(
            f"{name} must be a number >= 0 (the largest perplexity change in % a stored form "
            f"may have, e.g. 1), got {value!r}"
        )


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConnectorError(f"{name} must be true or false, got {value!r}")


def integer(name: str, value: Any) -> None:
    if value is not None and not _is_int(value):
        raise ConnectorError(f"{name} must be an integer, got {value!r}")


def positive_integer(name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ConnectorError(f"{name} must be a positive integer, got {value!r}")


def byte_cap(name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value <= 0):
        raise ConnectorError(f"{name} must be a positive number of bytes, got {value!r}")


def modes(name: str, value: Sequence[str]) -> None:
    for mode in value:
        if mode not in MODES:
            raise ConnectorError(f"unknown mode {mode!r} in {name}; choose from {', '.join(MODES)}")


def one_of(*choices: str) -> Check:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ConnectorError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")

    return check


def levels(name: str, value: Any) -> None:
    if value is not None and (not value or not all(_is_int(x) for x in value)):
        raise ConnectorError(f"{name} must be a non-empty list of integers, got {value!r}")


def scope_part(name: str, value: Any) -> None:
    try:
        check_scope_part(name, value)
    except StoreConfigError as exc:
        raise ConnectorError(str(exc)) from None


def secret(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ConnectorError(f"{name} must be a string")  # never echo a secret


def store_url(name: str, value: Any) -> None:
    if not isinstance(value, str) or "://" not in value:
        raise ConnectorError(
            f"{name} must be a URL like file:///path or redis://host:port/0, got {value!r}"
        )


def _check_fields(options: Any) -> None:
    for f in dataclasses.fields(options):
        if "check" in f.metadata:
            f.metadata["check"](f.name, getattr(options, f.name))


def default_mode(model: ModelIdentity) -> str:
    """``mode``'s default for an engine of ``model``: ``tcq`` where the model ships a tcq
    calibration with a default level (``cachegen.codec.shipped``; its smallest form at the
    same quality), else ``cachegen``. Read from the shipped files, never fitted."""
    from cachegen.codec.shipped import ships_tcq_default  # the codec loads numba: on first use

    return TCQ if ships_tcq_default(model.fingerprint) else CACHEGEN


# ---- the options ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks of the connector."""

    mode: str = option(
        REQUEST,
        "raw | int8 | fp8 | cachegen | tcq | adaptive (default: tcq where the model ships a tcq "
        "calibration, else cachegen)",
        one_of(*MODES),
        CACHEGEN,
        model_default=default_mode,
    )
    level: int | None = option(
        REQUEST, "quality level of cachegen or tcq (default: the codec's default)", integer
    )
    slo_ms: float | None = option(
        REQUEST, "time budget of the load in adaptive mode", positive_number
    )
    max_loss_pct: float | None = option(
        REQUEST, "adaptive's quality bound: the largest perplexity change (%) of a form", loss_bound
    )
    bandwidth_mbps: float | None = option(
        REQUEST, "rate limit of the transfer in Mbit/s (experiments)", positive_number
    )
    rtt_ms: float = option(
        REQUEST,
        "added round-trip time of the transfer in ms (experiments)",
        non_negative_number,
        0.0,
    )
    load: bool = option(REQUEST, "load this request's prefix from the store", boolean, True)
    save: bool = option(REQUEST, "store this request's prefix", boolean, True)
    skip_out_of_window: bool = option(
        REQUEST, "fetch sliding layers' parts only within the window", boolean, True
    )
    # The request's key scope (tenant, cache_salt, what else makes its KV), set by the scheduler,
    # never by a client's kv_transfer_params: not an option.
    salt: str | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.mode == "adaptive" and self.slo_ms is None and self.max_loss_pct is None:
            raise ConnectorError(
                "adaptive mode needs slo_ms (the time budget for loading the prefix) or "
                "max_loss_pct (the quality bound of the fastest stored form)"
            )
        if self.bandwidth_mbps is not None or self.rtt_ms:
            link_opener()  # an emulated link is the lab's: refused where it is not installed

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

    store: str = option(
        ENGINE,
        "chunk store URL: file:///dir or redis://host:port/db",
        store_url,
        default_factory=default_store_url,
    )
    chunk_tokens: int = option(
        ENGINE,
        "tokens per stored chunk, a multiple of vLLM's block size",
        positive_integer,
        CHUNK_TOKENS,
    )
    save_modes: tuple[str, ...] = option(
        ENGINE, "modes whose encodings are written after a prefill (default: [mode])", modes, ()
    )
    cachegen_levels: tuple[int, ...] | None = option(
        ENGINE, "cachegen levels stored (default: the save ladder)", levels
    )
    tcq_levels: tuple[int, ...] | None = option(
        ENGINE, "tcq levels stored when tcq is saved (default: tcq's save ladder)", levels
    )
    shaper: str = option(
        ENGINE, "how bandwidth_mbps is enforced", one_of(*RATE_SHAPERS), "token-bucket"
    )
    prefill_tokens_per_s: float | None = option(
        ENGINE,
        "prefill rate adaptive prices recomputation with (default: measured)",
        positive_number,
    )
    load_async: bool = option(ENGINE, "load in a background thread", boolean, True)
    save_async: bool = option(ENGINE, "encode and store in a background thread", boolean, True)
    save_wait_ms: float = option(
        ENGINE,
        "how long a request waits for this engine's save of its chunks",
        non_negative_number,
        2000.0,
    )
    tenant: str | None = option(ENGINE, "a scope of every chunk key of this engine", scope_part)
    store_secret: str | None = option(
        ENGINE,
        "MAC secret records are signed with (default: $CACHEGEN_STORE_SECRET)",
        secret,
        repr=False,
    )
    max_record_bytes: int | None = option(ENGINE, "largest record a load reads", byte_cap)
    max_load_bytes: int | None = option(ENGINE, "most bytes one request's load fetches", byte_cap)
    profile_source: str = option(
        ENGINE, "where the cachegen codec profile comes from", one_of(*PROFILE_SOURCES), "store"
    )
    defaults: RequestOptions = field(default_factory=RequestOptions)

    def __post_init__(self) -> None:
        _check_fields(self)

    @classmethod
    def from_extra_config(
        cls, extra: dict[str, Any] | None, model: ModelIdentity | None = None
    ) -> ConnectorConfig:
        """The configuration of ``kv_connector_extra_config`` ``extra`` for an engine of
        ``model``: the options it leaves out that have a ``model_default`` take the model's
        (without ``model``, their declared defaults)."""
        extra = dict(extra or {})
        unknown = set(extra) - ENGINE_KEYS
        if unknown:
            raise ConnectorError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                f"the cachegen connector accepts {sorted(ENGINE_KEYS)}"
            )
        if model is not None:
            extra = {**_model_defaults(model), **extra}
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


def _model_defaults(model: ModelIdentity) -> dict[str, Any]:
    """The defaults of the options declared with a ``model_default``, for ``model``."""
    return {
        f.name: f.metadata["model_default"](model)
        for cls in (ConnectorConfig, RequestOptions)
        for f in dataclasses.fields(cls)
        if "model_default" in f.metadata
    }


def _keys(cls: type, scope: str) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("scope") == scope)


REQUEST_KEYS = _keys(RequestOptions, REQUEST)
ENGINE_KEYS = REQUEST_KEYS | _keys(ConnectorConfig, ENGINE)


def describe_options() -> list[dict[str, str]]:
    """Every option's key, scope and one-line doc, engine-wide ones first (as in the docs)."""
    rows = []
    for cls in (ConnectorConfig, RequestOptions):
        for f in dataclasses.fields(cls):
            if "scope" in f.metadata:
                rows.append({"key": f.name, "scope": f.metadata["scope"], "doc": f.metadata["doc"]})
    return rows
