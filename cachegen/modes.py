"""The ways a server can get a context's KV: one vocabulary for the CLI, the connector,
results and plots.

  ``recompute``      the engine prefills the whole prompt from its tokens (no KV is loaded)
  ``raw``            16-bit KV as the engine holds it
  ``int8``, ``fp8``  the quantization baselines
  ``cachegen-<L>``   the CacheGen codec at quality level L (the connector takes ``mode``
                     ``cachegen`` plus ``level`` L)
  ``tcq-<L>``        the transform codec ``tcq`` at level L (``mode`` ``tcq`` plus ``level``)
  ``adaptive``       CacheGen with a per-chunk level choice under a load-time budget
"""

from __future__ import annotations

from dataclasses import dataclass

from cachegen.errors import InputError

RECOMPUTE = "recompute"
CACHEGEN = "cachegen"
TCQ = "tcq"
LEVELED = (CACHEGEN, TCQ)  # codecs whose modes name a level
ADAPTIVE = "adaptive"
KV_BASELINES = ("raw", "int8", "fp8")
CONNECTOR_MODES = (
    *KV_BASELINES,
    CACHEGEN,
    TCQ,
    ADAPTIVE,
)  # the modes that load KV through the connector
MODES = (RECOMPUTE, *CONNECTOR_MODES)


@dataclass(frozen=True, order=True)
class Mode:
    mode: str  # one of MODES
    level: int | None = None

    @property
    def label(self) -> str:
        return f"{self.mode}-{self.level}" if self.level is not None else self.mode

    @property
    def moves_kv(self) -> bool:
        return self.mode != RECOMPUTE

    @property
    def codec_name(self) -> str | None:
        """The codec that encodes this mode's KV (None: recompute; adaptive mixes levels)."""
        return None if self.mode in (RECOMPUTE, ADAPTIVE) else self.mode

    @classmethod
    def parse(cls, label: str) -> Mode:
        """``recompute``, ``raw``, ``int8``, ``fp8``, ``adaptive``, ``cachegen-<level>`` or
        ``tcq-<level>``."""
        if label in MODES and label not in LEVELED:
            return cls(label)
        prefix, _, level = label.partition("-")
        if prefix in LEVELED and level.isdigit():
            return cls(prefix, int(level))
        raise InputError(
            f"unknown mode {label!r}; use {', '.join(m for m in MODES if m not in LEVELED)}, "
            "cachegen-<level> or tcq-<level>"
        )
