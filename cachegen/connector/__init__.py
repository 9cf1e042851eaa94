"""The cachegen KV connector for stock vLLM (``KVConnectorBase_V1``).

Use it with ``kv_connector="CacheGenConnector"`` and
``kv_connector_module_path="cachegen.connector"`` (see docs/connector.md). vLLM is imported
only when the connector class is first touched, so the layout and configuration helpers stay
importable without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CacheGenConnector"]


def __getattr__(name: str) -> Any:
    if name == "CacheGenConnector":
        from cachegen.connector.connector import CacheGenConnector

        return CacheGenConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
