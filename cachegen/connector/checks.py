"""Start-up checks: which models and vLLM KV cache configurations the connector can serve.

``CacheGenConnector.__init__`` runs them in both roles before it opens the store, so a model or
a configuration the connector cannot serve stops vLLM at start-up, with a message that names
the remedy, and nothing is ever stored for it. They need no engine: tests call them with
config dicts and synthetic ``KVCacheConfig`` objects.

What the connector needs: every layer keeps the KV of every token of the prompt, in one block
table. A stored chunk holds all layers of its tokens, and a later request may attend to any
of them.

* Sliding-window layers (Gemma 3: five of every six) are fine when vLLM gives them a slot for
  every token. That is what happens with vLLM's hybrid KV cache manager (HMA) off: the layers
  form one KV cache group of ``FullAttentionSpec`` (the window is applied by the attention
  kernel only). vLLM turns HMA off by itself for a connector that does not subclass
  ``SupportsHMA``, like this one, unless the user asks for it explicitly; then vLLM's
  connector factory refuses the connector before this code runs. With HMA on, the layers of
  each kind get their own group and sliding layers drop the blocks outside their window, so
  a stored prefix would not be whole: refused here with the remedy (``check_kv_cache_config``).
* A model whose layers all slide by the same window keeps one ``SlidingWindowSpec`` group
  even with HMA off, and vLLM frees (nulls) the blocks behind the window: refused.
* Attention kinds that ``cachegen.models.attention_windows`` does not know: refused, naming
  the layer (``check_model``).
"""

from __future__ import annotations

from typing import Any

from cachegen import models
from cachegen.connector.errors import ConnectorError
from cachegen.errors import ModelError

HMA_REMEDY = (
    "run vLLM with disable_hybrid_kv_cache_manager=True "
    "(command line: --disable-hybrid-kv-cache-manager), which gives every layer a slot for "
    "every token in one KV cache group"
)
NOT_SERVED = "start vLLM without the cachegen kv_transfer_config to serve it without the connector"


def check_model(config: dict[str, Any], model: str) -> tuple[int | None, ...]:
    """Each layer's attention window (``None``: full attention) of the served model, or a
    ``ConnectorError`` that names the layer the connector cannot handle and the remedy."""
    try:
        return models.attention_windows(config)
    except ModelError as exc:
        raise ConnectorError(
            f"the cachegen connector cannot serve {model}: {exc}. Remedy: serve a model whose "
            f"layers all use full or sliding-window attention, or {NOT_SERVED}"
        ) from exc


def _spec_kinds(spec: Any) -> list[type]:
    """The spec classes of a group's layers (``UniformTypeKVCacheSpecs`` wraps one per layer)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return [type(s) for s in inner.values()]
    return [type(spec)]


def _describe(groups: Any) -> str:
    return ", ".join(
        f"{'/'.join(sorted({k.__name__ for k in _spec_kinds(g.kv_cache_spec)}))} "
        f"x{len(g.layer_names)} layers"
        for g in groups
    )


def check_kv_cache_config(kv_cache_config: Any, *, hybrid_manager: bool = True) -> None:
    """Refuse a vLLM KV cache configuration in which not every layer keeps every token.

    ``kv_cache_config`` is vLLM's ``KVCacheConfig`` (``None``: nothing to check, as when vLLM
    builds a connector without one); ``hybrid_manager``: whether vLLM's hybrid KV cache
    manager is on (``not scheduler_config.disable_hybrid_kv_cache_manager``).
    """
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups)
    if len(groups) > 1 and not hybrid_manager:
        raise ConnectorError(
            f"the cachegen connector supports one KV cache group, and vLLM made "
            f"{len(groups)} ({_describe(groups)}) with its hybrid KV cache manager off: this "
            f"model's layers need KV caches of different kinds. Remedy: serve another model, "
            f"or {NOT_SERVED}"
        )
    if len(groups) > 1:
        raise ConnectorError(
            f"the cachegen connector supports one KV cache group, but vLLM made "
            f"{len(groups)} ({_describe(groups)}): vLLM's hybrid KV cache manager is on, so "
            "each attention kind keeps its own block table and sliding-window layers drop the "
            f"tokens behind their window. Remedy: {HMA_REMEDY}"
        )
    for group in groups:
        kinds = _spec_kinds(group.kv_cache_spec)
        # Exact class: subclasses of FullAttentionSpec (MLA, sink, R-SWA) place or drop
        # tokens differently.
        if all(kind is FullAttentionSpec for kind in kinds):
            continue
        if all(issubclass(kind, SlidingWindowSpec) for kind in kinds):
            raise ConnectorError(
                f"the cachegen connector cannot serve a model whose layers all use "
                f"sliding-window attention ({_describe(groups)}): vLLM frees the blocks of "
                "tokens behind the window, so a stored prefix would not be whole. Remedy: "
                "start vLLM with disable_sliding_window=True (command line: "
                "--disable-sliding-window; max_model_len is then capped at the window), or "
                f"{NOT_SERVED}"
            )
        raise ConnectorError(
            f"the cachegen connector stores the KV of full and sliding-window attention "
            f"layers only, and vLLM's KV cache group holds {_describe(groups)}. Remedy: "
            f"serve another model, or {NOT_SERVED}"
        )
