"""The lab connector's request options (a link's rate and RTT) and its engine's shaper."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cachegen.connector.config import (
    REQUEST,
    ConnectorConfig,
    RequestOptions,
    non_negative_number,
    one_of,
    option,
    positive_number,
)
from cachegen_lab.network.link import RATE_SHAPERS

SHAPER = "shaper"  # the lab engine's key in kv_connector_extra_config
DEFAULT_SHAPER = "token-bucket"


@dataclass(frozen=True)
class LabRequestOptions(RequestOptions):
    """A request's options with the link its load goes over."""

    bandwidth_mbps: float | None = option(
        REQUEST, "rate limit of the transfer in Mbit/s (the lab's connector)", positive_number
    )
    rtt_ms: float = option(
        REQUEST,
        "added round-trip time of the transfer in ms (the lab's connector)",
        non_negative_number,
        0.0,
    )


def lab_config(extra: dict[str, Any], identity: Any = None) -> tuple[ConnectorConfig, str]:
    """The connector configuration and the shaper of a lab engine's
    ``kv_connector_extra_config`` ``extra``."""
    extra = dict(extra)
    shaper = extra.pop(SHAPER, DEFAULT_SHAPER)
    one_of(*RATE_SHAPERS)(SHAPER, shaper)
    return ConnectorConfig.from_extra_config(extra, identity, LabRequestOptions), shaper
