"""Bandwidth traces: piecewise-constant link rates over time.

A trace is a list of ``(duration_s, mbps)`` segments; the last one lasts forever. The token
bucket follows a trace in real time, and the simulator integrates it exactly, so the same
trace drives real-socket runs and simulated controller evaluations.

Spec strings (CLI):  ``constant:100``, ``step:500:100:0.5`` (500 Mbit/s, then 100 from
0.5 s on), ``walk:300:SEED`` (random walk around 300 Mbit/s, 50 ms steps).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass

import numpy as np

from cachegen.errors import InputError
from cachegen.fileio import check_version, versioned

SCHEMA = "cachegen-bandwidth-trace"
VERSION = 1


@dataclass(frozen=True)
class BandwidthTrace:
    name: str
    segments: tuple[tuple[float, float], ...]  # (duration_s, mbps); the last one is open-ended

    def __post_init__(self) -> None:
        if not self.segments:
            raise InputError(f"trace {self.name} has no segments")
        for duration, mbps in self.segments:
            if duration <= 0 or mbps <= 0 or not math.isfinite(mbps):
                raise InputError(
                    f"trace {self.name}: segment ({duration} s, {mbps} Mbit/s) must be positive"
                )
        starts = [0.0]
        for duration, _ in self.segments[:-1]:
            starts.append(starts[-1] + duration)
        object.__setattr__(self, "_starts", starts)
        bytes_at = [0.0]
        for duration, mbps in self.segments[:-1]:
            bytes_at.append(bytes_at[-1] + duration * mbps * 1e6 / 8)
        object.__setattr__(self, "_bytes_at", bytes_at)

    # ---- constructors ----------------------------------------------------------------

    @classmethod
    def constant(cls, mbps: float) -> BandwidthTrace:
        return cls(f"constant-{mbps:g}", ((1.0, float(mbps)),))

    @classmethod
    def step(cls, before_mbps: float, after_mbps: float, at_s: float) -> BandwidthTrace:
        return cls(
            f"step-{before_mbps:g}-{after_mbps:g}@{at_s:g}",
            ((at_s, float(before_mbps)), (1.0, float(after_mbps))),
        )

    @classmethod
    def random_walk(
        cls,
        mean_mbps: float,
        seed: int,
        *,
        step_s: float = 0.05,
        duration_s: float = 30.0,
        sigma: float = 0.15,
        low: float = 0.2,
        high: float = 2.0,
    ) -> BandwidthTrace:
        """Log-space random walk: each ``step_s`` the rate is multiplied by ``exp(N(0, sigma))``,
        kept within ``[low, high] x mean_mbps``."""
        rng = np.random.default_rng(seed)
        level = 0.0
        segments = []
        for _ in range(max(1, int(duration_s / step_s))):
            segments.append((step_s, float(mean_mbps * math.exp(level))))
            level = float(np.clip(level + rng.normal(0.0, sigma), math.log(low), math.log(high)))
        return cls(f"walk-{mean_mbps:g}-s{seed}", tuple(segments))

    @classmethod
    def parse(cls, spec: str) -> BandwidthTrace:
        kind, _, rest = spec.partition(":")
        args = rest.split(":") if rest else []
        try:
            if kind == "constant" and len(args) == 1:
                return cls.constant(float(args[0]))
            if kind == "step" and len(args) == 3:
                return cls.step(float(args[0]), float(args[1]), float(args[2]))
            if kind == "walk" and len(args) == 2:
                return cls.random_walk(float(args[0]), int(args[1]))
        except ValueError:
            pass
        raise InputError(
            f"cannot read bandwidth trace {spec!r}: use constant:MBPS, step:MBPS:MBPS:AT_S "
            "or walk:MEAN_MBPS:SEED"
        )

    def to_json(self) -> str:
        return json.dumps(
            versioned(SCHEMA, VERSION, {"name": self.name, "segments": self.segments})
        )

    @classmethod
    def from_json(cls, text: str) -> BandwidthTrace:
        try:
            data = check_version(json.loads(text), SCHEMA, (VERSION,), "bandwidth trace JSON")
            return cls(str(data["name"]), tuple((float(d), float(r)) for d, r in data["segments"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise InputError(f"bad bandwidth trace JSON: {exc}") from exc

    # ---- integration -----------------------------------------------------------------

    def rate_bps(self, t: float) -> float:
        """Link rate in bytes per second at ``t`` seconds after the trace's origin."""
        i = max(0, bisect.bisect_right(self._starts, t) - 1)
        return self.segments[i][1] * 1e6 / 8

    def bytes_until(self, t: float) -> float:
        """Bytes the link can carry from the origin to time ``t``."""
        t = max(0.0, t)
        i = max(0, bisect.bisect_right(self._starts, t) - 1)
        return self._bytes_at[i] + (t - self._starts[i]) * self.segments[i][1] * 1e6 / 8

    def time_at_bytes(self, nbytes: float) -> float:
        """Earliest time at which the link has carried ``nbytes`` since the origin."""
        i = max(0, bisect.bisect_right(self._bytes_at, nbytes) - 1)
        return self._starts[i] + (nbytes - self._bytes_at[i]) / (self.segments[i][1] * 1e6 / 8)

    def mean_mbps(self, t0: float, t1: float) -> float:
        return (self.bytes_until(t1) - self.bytes_until(t0)) * 8 / 1e6 / (t1 - t0)
