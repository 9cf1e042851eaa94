"""What every server of a fleet runs, per configuration:

``prefix-cache``  vLLM with its own prefix cache, no connector (reuse only within a server)
``recompute``     no cache at all: every prompt is prefilled
``raw``, ``int8``  the connector in that mode, vLLM's prefix cache on
``default``       the connector in its default mode for the model (tcq where the model ships a
                  tcq calibration, else cachegen), prefix cache on
``adaptive``      the connector in adaptive mode under ``slo_ms``, prefix cache on
``lmcache``       LMCache's own connector (``LMCacheConnectorV1``) instead of ours, set by
                  LMCache's environment variables, sharing the bench's Redis through LMCache,
                  prefix cache on; on a GPU machine only (``cachegen_lab.fleet.lmcache``)

The connector's servers of one configuration share one store; ``lmcache``'s share the Redis of
``--store``. Without ``--configs`` every configuration but ``lmcache`` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachegen.modes import ADAPTIVE, RECOMPUTE
from cachegen_lab.fleet import lmcache as lmcache_connector
from cachegen_lab.fleet.lmcache import LMCACHE

PREFIX_CACHE = "prefix-cache"
DEFAULT = "default"
DEFAULT_CONFIGS = (PREFIX_CACHE, RECOMPUTE, "raw", "int8", DEFAULT, ADAPTIVE)
CONFIGS = (*DEFAULT_CONFIGS, LMCACHE)
SLO_MS = 500.0


@dataclass(frozen=True)
class Config:
    name: str
    mode: str  # the OpenAIServer's mode: recompute (no connector of ours) or a connector mode
    prefix_caching: bool
    connector_extra: dict[str, Any]
    lmcache: bool = False  # LMCache's connector instead of ours (mode recompute)

    @property
    def connector(self) -> bool:
        """Our connector: its store, link rates, reports and census."""
        return self.mode != RECOMPUTE

    def server_args(self) -> tuple[str, ...]:
        """vLLM options this configuration adds to every server's."""
        return lmcache_connector.server_args() if self.lmcache else ()

    def server_env(self, store: str | None) -> dict[str, str]:
        """The environment this configuration adds to every server's, sharing ``store``."""
        return lmcache_connector.environment(store) if self.lmcache else {}

    def describe(self) -> dict[str, Any]:
        described = {
            "config": self.name,
            "mode": self.mode,
            "prefix_caching": self.prefix_caching,
            "connector": self.connector,
            "connector_extra": self.connector_extra,
        }
        if self.lmcache:  # the store's URL is the setup's, without its password
            described["kv_transfer_config"] = lmcache_connector.TRANSFER
            described["lmcache_env"] = lmcache_connector.settings()
        return described


def default_mode(model: str) -> str:
    """The connector's default mode for an engine of ``model``."""
    from cachegen.connector.config import default_mode as connector_default
    from cachegen.models import resolve

    return connector_default(resolve(model).identity())


def config(name: str, model: str, slo_ms: float = SLO_MS) -> Config:
    if name == PREFIX_CACHE:
        return Config(name, RECOMPUTE, True, {})
    if name == RECOMPUTE:
        return Config(name, RECOMPUTE, False, {})
    if name == DEFAULT:
        return Config(name, default_mode(model), True, {})
    if name == ADAPTIVE:
        return Config(name, ADAPTIVE, True, {"slo_ms": slo_ms})
    if name == LMCACHE:
        return Config(name, RECOMPUTE, True, {}, lmcache=True)
    if name in CONFIGS:
        return Config(name, name, True, {})
    raise ValueError(f"unknown fleet configuration {name!r}")
