"""``CacheGenLabConnector``: cachegen's connector, its loads over the links requests name."""

from __future__ import annotations

from typing import Any

from cachegen.connector.config import ConnectorConfig
from cachegen.connector.connector import CacheGenConnector
from cachegen_lab.connector.links import EmulatedLinks
from cachegen_lab.connector.options import LabRequestOptions, lab_config


class CacheGenLabConnector(CacheGenConnector):
    """cachegen's connector with emulated links, for the lab's engines."""

    options_type = LabRequestOptions

    def read_config(self, extra: dict[str, Any], identity: Any) -> ConnectorConfig:
        config, self.shaper = lab_config(extra, identity)
        return config

    def source_pool(self, store: Any) -> EmulatedLinks:
        return EmulatedLinks(store, self.shaper)
