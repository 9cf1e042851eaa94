"""Connector options: one dataclass each for the engine (``kv_connector_extra_config``) and a
request (``kv_transfer_params``, whose keys in ``kv_connector_extra_config`` set the engine's
defaults).

Each option is declared once, as a field made by ``option``: its scope, default (or the
model's, ``model_default``), check and a one-line doc; the key sets, the validation and
``describe_options()`` are read from the declarations, and a test checks docs/connector.md's
"Options" tables against them.

The engine owns every choice: a request's options choose only among what the engine stores and
allows (its modes, its stored levels and forms, adaptive within the engine's time bound), and
nothing a client sends opens a connection or fits a model. A value of the wrong type, out of
range or not finite is a ``ConnectorError`` (the request recomputes, its report says why).
Forms are named as in ``cachegen.modes`` (``cachegen-11-packed``); a store slot number is never
an option's value. A request's
``cache_salt`` (vLLM's isolation key) and the engine's ``tenant`` are part of its chunk keys
(docs/security.md); a client cannot set the key scope through ``kv_transfer_params``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from cachegen.connector.errors import ConnectorError
from cachegen.constants import CHUNK_TOKENS
from cachegen.errors import InputError
from cachegen.kv import ModelIdentity
from cachegen.modes import (
    ADAPTIVE,
    CACHEGEN,
    LEVEL_LIMIT,
    TCQ,
    Form,
    configured_form,
    connector_modes,
)
from cachegen.store import StoreConfigError, default_store_url, parse_size
from cachegen.store.keys import check_scope_part
from cachegen.store.record import SECRET_ENV
from cachegen.store.secret_files import inline_password_error, read_secret_file
from cachegen.store.url import without_password

PROFILE_SOURCES = ("store", "local")
CLIENT_REPORTS = ("reasons", "full", "none")
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
    """A finite int or float (never a bool, NaN or an infinity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_number(name: str, value: Any) -> None:
    if value is not None and (not _is_number(value) or value <= 0):
        raise ConnectorError(f"{name} must be a positive number, got {value!r}")


def non_negative_number(name: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise ConnectorError(f"{name} must be a number >= 0, got {value!r}")


def loss_bound(name: str, value: Any) -> None:
    if value is not None and (not _is_number(value) or value < 0):
        raise ConnectorError(
            f"{name} must be a number >= 0 (the largest perplexity change in % a stored form "
            f"may have, e.g. 1), got {value!r}"
        )


def boolean(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConnectorError(f"{name} must be true or false, got {value!r}")


def level(name: str, value: Any, codec: str = CACHEGEN) -> None:
    """A level of ``codec``: an integer 0..32767. A larger one is a store slot of earlier
    releases (a packed form's), never an option's value: the error names the form that
    replaces it."""
    if value is None:
        return
    if not _is_int(value) or value < 0:
        raise ConnectorError(f"{name} must be a level, an integer >= 0, got {value!r}")
    if value >= LEVEL_LIMIT:
        _configured_form(name, value, codec)


def _configured_form(name: str, value: int | str, codec: str) -> Form:
    """``cachegen.modes.configured_form`` of option ``name``'s ``value``."""
    try:
        return configured_form(value, codec)
    except InputError as exc:
        raise ConnectorError(f"{name}: {exc}") from None


def form_name(name: str, value: Any) -> None:
    if value is not None:
        _form(name, value)


def _form(name: str, value: Any) -> Form:
    try:
        return Form.parse(value if isinstance(value, str) else repr(value))
    except InputError as exc:
        raise ConnectorError(f"{name}: {exc}") from None


def positive_integer(name: str, value: Any) -> None:
    if not _is_int(value) or value <= 0:
        raise ConnectorError(f"{name} must be a positive integer, got {value!r}")


def byte_cap(name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value <= 0):
        raise ConnectorError(f"{name} must be a positive number of bytes, got {value!r}")


def mode_name(name: str, value: Any) -> None:
    """A mode of ``cachegen.modes.connector_modes`` (read when checked: a process may join
    codecs to the vocabulary after this module is imported)."""
    one_of(*connector_modes())(name, value)


def modes(name: str, value: Sequence[str]) -> None:
    for mode in value:
        if mode not in connector_modes():
            raise ConnectorError(
                f"unknown mode {mode!r} in {name}; choose from {', '.join(connector_modes())}"
            )


def one_of(*choices: str) -> Check:
    def check(name: str, value: Any) -> None:
        if value not in choices:
            raise ConnectorError(f"unknown {name} {value!r}; choose one of {', '.join(choices)}")

    return check


def form_names(name: str, value: Any) -> None:
    if value is not None and (not value or not all(isinstance(x, str) for x in value)):
        raise ConnectorError(f"{name} must be a non-empty list of form names, got {value!r}")
    for item in value or ():
        _form(name, item)


def stored_forms(name: str, codec: str, value: Any) -> tuple[str, ...] | None:
    """The names of the forms of ``value``, a configured list of ``codec``'s levels (integers:
    coded) and form names (``cachegen-11-packed``). A store slot number is refused, naming the
    form that replaces it."""
    if value is None:
        return None
    if isinstance(value, (str, int)) or not isinstance(value, (list, tuple)) or not value:
        raise ConnectorError(f"{name} must be a non-empty list of levels, got {value!r}")
    for item in value:
        if not isinstance(item, str):
            level(name, item, codec)
    return tuple(_configured_form(name, item, codec).label for item in value)


def scope_part(name: str, value: Any) -> None:
    try:
        check_scope_part(name, value)
    except StoreConfigError as exc:
        raise ConnectorError(str(exc)) from None


def secret(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, str):
        raise ConnectorError(f"{name} must be a string")  # never echo a secret


def secret_file(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConnectorError(f"{name} must be the path of a file, got {value!r}")


# kv_connector_extra_config travels on vLLM's command line and is in its start-up log (vLLM
# logs its non-default arguments): a secret or password there is readable by whoever sees them.
_ON_THE_COMMAND_LINE = "kv_connector_extra_config is on vLLM's command line and in its log"
INLINE_SECRET = (
    f"store_secret cannot be given inline: {_ON_THE_COMMAND_LINE}. Put the secret in a file only "
    "the server's user can read (chmod 600) and set store_secret_file to its path, or set the "
    f"environment variable {SECRET_ENV}"
)


def store_url(name: str, value: Any) -> None:
    if not isinstance(value, str) or "://" not in value:
        shown = "a value with '@'" if isinstance(value, str) and "@" in value else repr(value)
        raise ConnectorError(
            f"{name} must be a URL like file:///path or redis://host:port/0, got {shown}"
        )
    refusal = inline_password_error(
        value, f"{name} {without_password(value)!r}", _ON_THE_COMMAND_LINE
    )
    if refusal is not None:
        raise ConnectorError(str(refusal))


def _store_secret(path: str | None) -> str | None:
    """The secret in ``store_secret_file`` (None without one), read at start-up."""
    if path is None:
        return None
    secret_file(STORE_SECRET_FILE, path)
    try:
        return read_secret_file(path, STORE_SECRET_FILE)
    except StoreConfigError as exc:
        raise ConnectorError(str(exc)) from None


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
        mode_name,
        CACHEGEN,
        model_default=default_mode,
    )
    level: int | None = option(
        REQUEST,
        "quality level of cachegen or tcq, one the engine stores (default: the codec's default)",
        level,
    )
    form: str | None = option(
        REQUEST,
        "a stored form to load, such as cachegen-11-packed or tcq-22 (sets mode and level)",
        form_name,
    )
    slo_ms: float | None = option(
        REQUEST, "time budget of the load in adaptive mode, up to max_slo_ms", positive_number
    )
    max_loss_pct: float | None = option(
        REQUEST, "adaptive's quality bound: the largest perplexity change (%) of a form", loss_bound
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

    @classmethod
    def keys(cls) -> frozenset[str]:
        """The keys a request's ``kv_transfer_params`` may hold."""
        return _keys(cls, REQUEST)

    def override(self, params: dict[str, Any] | None) -> RequestOptions:
        """These options with a request's ``kv_transfer_params`` applied on top; ``form``
        names the mode, the level and the packing in one."""
        if not params:
            return self
        if not isinstance(params, dict):
            raise ConnectorError(f"kv_transfer_params must be an object, got {params!r}")
        unknown = set(params) - self.keys()
        if unknown:
            raise ConnectorError(
                f"unknown kv_transfer_params {sorted(map(str, unknown))}; the cachegen "
                f"connector accepts {sorted(self.keys())}"
            )
        mode = params.get("mode", self.mode)
        level(LEVEL, params.get(LEVEL), TCQ if mode == TCQ else CACHEGEN)
        params = dict(params)
        if params.get(FORM) is not None:
            chosen = _form(FORM, params[FORM])
            if params.get(LEVEL) is not None or params.get("mode", chosen.codec) != chosen.codec:
                raise ConnectorError(f"form {params[FORM]!r} names its mode and level: drop them")
            params.update(mode=chosen.codec, level=chosen.level, form=chosen.label)
        elif "mode" in params or LEVEL in params:
            params[FORM] = None  # the mode and level asked for replace a default form
        return dataclasses.replace(self, **params)


@dataclass(frozen=True)
class ConnectorConfig:
    """Engine-wide connector configuration."""

    store: str = option(
        ENGINE,
        "chunk store URL: file:///dir or redis://host:port/db (a password by "
        "?password_file=PATH or ?password_env=NAME, never inline)",
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
    cachegen_levels: tuple[str, ...] | None = option(
        ENGINE,
        'cachegen levels and forms stored, such as [11, "cachegen-11-packed"] (default: '
        "the save ladder)",
        form_names,
    )
    tcq_levels: tuple[str, ...] | None = option(
        ENGINE,
        "tcq levels and forms stored when tcq is saved, such as [22] (default: tcq's save ladder)",
        form_names,
    )
    max_slo_ms: float = option(
        ENGINE, "the largest slo_ms a request may ask for (ms)", positive_number, 60_000.0
    )
    prefill_tokens_per_s: float | None = option(
        ENGINE,
        "prefill rate adaptive prices recomputation with (default: measured)",
        positive_number,
    )
    load_async: bool = option(ENGINE, "load in background threads", boolean, True)
    load_threads: int = option(
        ENGINE,
        "threads that run background loads (a slow load holds only its own)",
        positive_integer,
        2,
    )
    load_timeout_s: float = option(
        ENGINE,
        "the longest one load may take (s); the rest of its prompt is computed",
        positive_number,
        60.0,
    )
    save_async: bool = option(ENGINE, "encode and store in a background thread", boolean, True)
    save_wait_ms: float = option(
        ENGINE,
        "how long a request waits for this engine's save of its chunks",
        non_negative_number,
        2000.0,
    )
    client_report: str = option(
        ENGINE,
        "what a request's report tells its client: reasons (reason codes only), full (every "
        "figure and error text: trusted clients) or none",
        one_of(*CLIENT_REPORTS),
        "reasons",
    )
    store_deadline_ms: float = option(
        ENGINE,
        "how long after a question the store's answer may come (ms); later is a miss",
        positive_number,
        500.0,
    )
    store_backoff_s: float = option(
        ENGINE,
        "how long the store counts as down after it failed or answered late (s)",
        positive_number,
        1.0,
    )
    tenant: str | None = option(ENGINE, "a scope of every chunk key of this engine", scope_part)
    store_secret_file: str | None = option(
        ENGINE,
        "file holding the MAC secret records are signed with (default: $CACHEGEN_STORE_SECRET)",
        secret_file,
    )
    # The secret read from store_secret_file (or given from Python), never an option: a value
    # in kv_connector_extra_config is refused (INLINE_SECRET).
    store_secret: str | None = field(default=None, repr=False, metadata={"check": secret})
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
        cls,
        extra: dict[str, Any] | None,
        model: ModelIdentity | None = None,
        options_type: type[RequestOptions] = RequestOptions,
    ) -> ConnectorConfig:
        """The configuration of ``kv_connector_extra_config`` ``extra`` for an engine of
        ``model``: the options it leaves out that have a ``model_default`` take the model's
        (without ``model``, their declared defaults). ``options_type``: the request options'
        class (a subclass may declare more, as the lab's connector does)."""
        extra = dict(extra or {})
        if "store_secret" in extra:
            raise ConnectorError(INLINE_SECRET)
        engine_keys = options_type.keys() | ENGINE_KEYS
        unknown = set(extra) - engine_keys
        if unknown:
            raise ConnectorError(
                f"unknown kv_connector_extra_config keys {sorted(unknown)}; "
                f"the cachegen connector accepts {sorted(engine_keys)}"
            )
        if model is not None:
            extra = {**_model_defaults(model), **extra}
        defaults = options_type().override(
            {k: extra.pop(k) for k in list(extra) if k in options_type.keys()}
        )
        save_modes = extra.pop("save_modes", None)
        if save_modes is None:
            save_modes = [defaults.mode]
        if isinstance(save_modes, str) or not isinstance(save_modes, (list, tuple)):
            raise ConnectorError(f"save_modes must be a list of modes, got {save_modes!r}")
        kwargs: dict[str, Any] = {"defaults": defaults, "save_modes": tuple(save_modes)}
        for name, codec in (("cachegen_levels", CACHEGEN), ("tcq_levels", TCQ)):
            kwargs[name] = stored_forms(name, codec, extra.pop(name, None))
        for name in ("max_record_bytes", "max_load_bytes"):
            if isinstance(extra.get(name), str):
                try:
                    extra[name] = parse_size(extra[name])
                except StoreConfigError as exc:
                    raise ConnectorError(f"{name}: {exc}") from None
        kwargs.update(extra)  # the engine-only keys
        kwargs["store_secret"] = _store_secret(extra.get(STORE_SECRET_FILE))
        return cls(**kwargs)

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes a request may ask for: the engine's mode and those it saves, and
        ``adaptive``, which chooses only among the forms stored."""
        return tuple(dict.fromkeys([self.defaults.mode, *self.save_modes, ADAPTIVE]))

    def request_options(self, params: dict[str, Any] | None) -> RequestOptions:
        """A request's options: the engine's defaults with its ``kv_transfer_params`` on top,
        within what this engine allows (:attr:`modes`, ``max_slo_ms``)."""
        options = self.defaults.override(params)
        if options.mode not in self.modes:
            raise ConnectorError(
                f"mode {options.mode!r} is not one this engine serves; it serves "
                f"{', '.join(self.modes)}"
            )
        if options.slo_ms is not None and options.slo_ms > self.max_slo_ms:
            raise ConnectorError(
                f"slo_ms={options.slo_ms:g} is above this engine's max_slo_ms ({self.max_slo_ms:g})"
            )
        return options

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


REQUEST_KEYS = RequestOptions.keys()
ENGINE_KEYS = REQUEST_KEYS | _keys(ConnectorConfig, ENGINE)
LEVEL, FORM = "level", "form"
STORE_SECRET_FILE = "store_secret_file"


def describe_options() -> list[dict[str, str]]:
    """Every option's key, scope and one-line doc, engine-wide ones first (as in the docs)."""
    rows = []
    for cls in (ConnectorConfig, RequestOptions):
        for f in dataclasses.fields(cls):
            if "scope" in f.metadata:
                rows.append({"key": f.name, "scope": f.metadata["scope"], "doc": f.metadata["doc"]})
    return rows
