"""What a transport's earlier loads measured, as priors for its next loads' controllers."""

from __future__ import annotations

import statistics
import threading
from collections.abc import Hashable
from typing import Any

from cachegen.stream import DECODE_EWMA, host_bound_mbps

# A measured goodput is remembered per link and becomes the controller's prior for the next load.
GOODPUT_EWMA = 0.5


def _moving_average(before: float | None, now: float, weight: float) -> float:
    return now if before is None else (1 - weight) * before + weight * now


class LoadHistory:
    """Moving averages of finished loads: each link's goodput, and per form name
    (``cachegen.modes.Form.label``) the decode seconds per token and the best
    goodput a host-bound load of it reached."""

    def __init__(self, chunk_tokens: int) -> None:
        self.chunk_tokens = chunk_tokens
        self.goodput_mbps: dict[Hashable, float] = {}
        self.decode_s_per_token: dict[str, float] = {}
        self.host_mbps: dict[str, float] = {}
        self._lock = threading.Lock()

    def initial_mbps(self, link: Hashable, nominal_mbps: float | None) -> float | None:
        """The goodput a load over ``link`` expects: the last loads' average, else its
        configured rate ``nominal_mbps``."""
        return self.goodput_mbps.get(link, nominal_mbps)

    def priors(self) -> tuple[dict[str, float], dict[str, float]]:
        """Copies of the per-form decode seconds per token and host ceilings (Mbit/s)."""
        with self._lock:
            return dict(self.decode_s_per_token), dict(self.host_mbps)

    def learn(self, stats: Any, link: Hashable, nominal_mbps: float | None) -> None:
        """Remember what a finished load over ``link`` (of configured
        rate ``nominal_mbps``) measured: the link's goodput; per form, its decode seconds per
        token (this load's median per record, averaged over loads), and its goodput over the
        whole load when it loaded every record in that one form and was bounded by the host,
        not the link (``cachegen.stream.host_bound_mbps``; the best such goodput is the form's
        ceiling on this host)."""
        per_form: dict[str, list[float]] = {}
        for chunk in stats.chunks:
            per_form.setdefault(chunk.form, []).append(chunk.decode_s / self.chunk_tokens)
        with self._lock:
            for name, samples in per_form.items():
                now = statistics.median(samples)
                before = self.decode_s_per_token.get(name)
                self.decode_s_per_token[name] = _moving_average(before, now, DECODE_EWMA)
            ceiling = host_bound_mbps(stats.bytes, stats.load_s, nominal_mbps)
            if len(per_form) == 1 and ceiling is not None:
                (name,) = per_form
                self.host_mbps[name] = max(self.host_mbps.get(name, 0.0), ceiling)
        if stats.transfer_s > 0 and stats.bytes:
            before = self.goodput_mbps.get(link)
            self.goodput_mbps[link] = _moving_average(before, stats.goodput_mbps, GOODPUT_EWMA)
