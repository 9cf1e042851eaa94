"""The lab's KV connector: cachegen's, with each request's load over a link the lab emulates.

Experiments measure loads at a rate and an RTT; a request to this connector names them in its
``kv_transfer_params`` (``bandwidth_mbps``, ``rtt_ms``), and the engine's ``shaper`` in
``kv_connector_extra_config`` says how the rate is enforced. Only the lab's engines use it
(``kv_connector="CacheGenLabConnector"``, ``kv_connector_module_path="cachegen_lab.connector"``);
a server runs ``cachegen.connector``'s, whose requests choose no link.

The lab's engines also store and load the lab's peer codecs (``cachegen_lab.peers``, modes of
every lab process), such as ``lmcache-cachegen``: a request and ``save_modes`` name them as
any mode.
"""

from __future__ import annotations

from typing import Any

LAB_CONNECTOR = "CacheGenLabConnector"
LAB_CONNECTOR_MODULE = "cachegen_lab.connector"
__all__ = ["CacheGenLabConnector"]


def __getattr__(name: str) -> Any:
    if name == LAB_CONNECTOR:  # vLLM is imported only when the class is first touched
        from cachegen_lab.connector.connector import CacheGenLabConnector

        return CacheGenLabConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
