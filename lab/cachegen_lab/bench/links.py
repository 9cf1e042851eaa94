"""The bandwidths a sweep's stream part loads at, and one name for the link with no rate
limit: ``unlimited`` (``null`` in JSON, ``None`` in code), a real socket through the chunk
server with no shaping, so the host (sender, receiver, verification) bounds the rate."""

from __future__ import annotations

UNLIMITED = "unlimited"


def link_label(bandwidth_mbps: float | None) -> str:
    """``100`` for a shaped link (Mbit/s), ``unlimited`` for an unshaped one."""
    return UNLIMITED if bandwidth_mbps is None else f"{bandwidth_mbps:g}"


def link_order(bandwidth_mbps: float | None) -> float:
    """Sort key: shaped links by rate, the unlimited one last."""
    return float("inf") if bandwidth_mbps is None else float(bandwidth_mbps)
