"""A token bucket that paces a sender to a constant rate or a bandwidth trace.

Debt model: ``consume(n)`` takes ``n`` tokens at once and, if that drives the bucket below
zero, sleeps until the link would have carried the debt. Tokens accrue from the trace's
rate, integrated exactly, so the long-run rate equals the configured one.

Like a NIC draining its queue, the link keeps "transmitting" while the sender is
backlogged, even if the sending process is descheduled for a while: tokens accrued during
a backlog are kept, and the sender catches up when it runs again, as the kernel would have
sent those bytes from the socket buffer meanwhile. Only when the sender had nothing to
send (``consume(..., fresh=True)``: the first bytes after an idle period) is the bucket
capped at ``burst_bytes``, so an idle link does not bank bandwidth.
"""

from __future__ import annotations

import threading
import time

from cachegen_lab.network.traces import BandwidthTrace

# Burst after an idle period: 2 ms of traffic (at least 64 KiB). Small, because a sender
# that falls behind catches up from its backlog instead of relying on the burst.
DEFAULT_BURST_S = 0.002


class TokenBucket:
    def __init__(
        self,
        rate: float | BandwidthTrace,
        *,
        burst_bytes: int | None = None,
        min_burst: int = 64 * 1024,
    ):
        self.trace = (
            rate if isinstance(rate, BandwidthTrace) else BandwidthTrace.constant(float(rate))
        )
        self.peak_bytes_per_s = max(mbps for _, mbps in self.trace.segments) * 1e6 / 8
        self.burst = float(
            burst_bytes
            if burst_bytes is not None
            else max(min_burst, self.peak_bytes_per_s * DEFAULT_BURST_S)
        )
        self._lock = threading.Lock()
        self._origin: float | None = None
        self._credited = 0.0  # trace bytes already turned into tokens
        self._tokens = self.burst

    @property
    def origin(self) -> float | None:
        return self._origin

    def set_origin(self, t: float | None = None) -> None:
        """Start the trace clock (default now); the first ``consume`` does it otherwise."""
        with self._lock:
            if self._origin is None:
                self._origin = time.monotonic() if t is None else t

    def consume(self, n: int, *, fresh: bool = False) -> float:
        """Take ``n`` bytes' worth of tokens, sleeping as needed; returns seconds slept.

        ``fresh``: these bytes end an idle period (the sender had nothing queued), so the
        tokens banked while idle are capped at one burst first.
        """
        self.set_origin()
        with self._lock:
            now = time.monotonic()
            available = self.trace.bytes_until(now - self._origin)
            self._tokens += available - self._credited
            self._credited = available
            if fresh:
                self._tokens = min(self._tokens, self.burst)
            self._tokens -= n
            debt = -self._tokens
            # When the debt is paid: the trace must carry `debt` more bytes after `now`.
            wake = (
                self._origin + self.trace.time_at_bytes(self._credited + debt) if debt > 0 else now
            )
        delay = wake - now
        if delay > 0:
            time.sleep(delay)
        return max(0.0, delay)
