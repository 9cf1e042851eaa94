"""What every server of a fleet runs, per configuration:

``prefix-cache``  vLLM with its own prefix cache, no connector (reuse only within a server)
``recompute``     no cache at all: every prompt is prefilled
``raw``, ``int8``  the connector in that mode, vLLM's prefix cache on
``default``       the connector in its default mode for the model (tcq where the model ships a
                  tcq calibration, else cachegen), prefix cache on
``adaptive``      the connector in adaptive mode under ``slo_ms``, prefix cache on

The connector's servers of one configuration share one store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachegen.modes import ADAPTIVE, RECOMPUTE

PREFIX_CACHE = "prefix-cache"
DEFAULT = "default"
CONFIGS = (PREFIX_CACHE, RECOMPUTE, "raw", "int8", DEFAULT, ADAPTIVE)
SLO_MS = 500.0


@dataclass(frozen=True)
class Config:
    name: str
    mode: str  # the OpenAIServer's mode: recompute (no connector) or a connector mode
    prefix_caching: bool
    connector_extra: dict[str, Any]

    @property
    def connector(self) -> bool:
        return self.mode != RECOMPUTE

    def describe(self) -> dict[str, Any]:
        return {
            "config": self.name,
            "mode": self.mode,
            "prefix_caching": self.prefix_caching,
            "connector": self.connector,
            "connector_extra": self.connector_extra,
        }


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
    if name in CONFIGS:
        return Config(name, name, True, {})
    raise ValueError(f"unknown fleet configuration {name!r}")
