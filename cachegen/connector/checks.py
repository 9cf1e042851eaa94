"""Start-up checks: which models and vLLM KV cache configurations the connector can serve.

``CacheGenConnector.__init__`` runs them in both roles before it opens the store, so a model or
a configuration the connector cannot serve stops vLLM at start-up, with a message that names
the remedy, and nothing is ever stored for it. They need no engine: tests call them with
config dicts and synthetic ``KVCacheConfig`` objects.

What the connector needs: every layer's KV cache group holds either full-attention or
sliding-window attention layers. A stored chunk holds the full-attention layers of its tokens
in one record and the sliding layers in another (``cachegen.connector.parts``).

* Sliding-window layers (Gemma 3: five of every six) are served with vLLM's hybrid KV cache
  manager (HMA) on or off. On (the default, the connector subclasses ``SupportsHMA``), each
  attention kind gets its own groups and the sliding groups keep only their window's blocks;
  the connector moves each group's blocks and saves the sliding part of the chunks those
  blocks hold. Off, the layers form one group of ``FullAttentionSpec`` with a slot for every
  token (the window is applied by the attention kernel only).
* A model whose layers all slide by the same window keeps ``SlidingWindowSpec`` groups even
  with HMA off, and vLLM frees (nulls) the blocks behind the window; its chunks are one record
  each, which would not be whole: refused.
* Attention kinds that ``cachegen.models.attention_windows`` does not know: refused, naming
  the layer (``check_model``).
"""

from __future__ import annotations

from typing import Any

from cachegen import models
from cachegen.connector.errors import ConnectorError
from cachegen.errors import ModelError

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


def check_kv_cache_config(kv_cache_config: Any) -> None:
    """Refuse a vLLM KV cache configuration whose groups the connector cannot store whole.

    ``kv_cache_config`` is vLLM's ``KVCacheConfig`` (``None``: nothing to check, as when vLLM
    builds a connector without one).
    """
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups = list(kv_cache_config.kv_cache_groups)
    sliding_groups = 0
    for group in groups:
        kinds = _spec_kinds(group.kv_cache_spec)
        # Exact classes: subclasses of FullAttentionSpec (MLA, sink, R-SWA) place or drop
        # tokens differently.
        if all(kind is FullAttentionSpec for kind in kinds):
            continue
        if not all(kind is SlidingWindowSpec for kind in kinds):
            raise ConnectorError(
                f"the cachegen connector stores the KV of full and sliding-window attention "
                f"layers only, and vLLM's KV cache groups hold {_describe(groups)}. Remedy: "
                f"serve another model, or {NOT_SERVED}"
            )
        sliding_groups += 1
    if groups and sliding_groups == len(groups):
        raise ConnectorError(
            f"the cachegen connector cannot serve a model whose layers all use "
            f"sliding-window attention ({_describe(groups)}): vLLM frees the blocks of "
            "tokens behind the window, so a stored prefix would not be whole. Remedy: "
            "start vLLM with disable_sliding_window=True (command line: "
            "--disable-sliding-window; max_model_len is then capped at the window), or "
            f"{NOT_SERVED}"
        )
