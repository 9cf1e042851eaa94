"""What one codec knows of its levels for one model, in one place: ``LevelCatalog``.

For each form of the codec (a level, coded or packed; the one form of a baseline) the catalog
answers its estimated size (bits per element of a chunk: the cachegen profile's tables, the tcq
model file's; ``cachegen.codec.cachegen.size``, ``cachegen.codec.tcq.size``), its measured
quality loss (``cachegen.codec.form_loss``: a calibration's target, a baseline's measured
loss), whether it is the codec's default, and whether it is a shipped calibrated level; and it
picks the storage ladders from them (:func:`storage_ladder`, :func:`tcq_storage_ladder`): the
forms a connector stores per chunk within a budget of bits.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachegen.codec.form_loss import form_losses
from cachegen.modes import CACHEGEN, CODED, LEVELED, PACKED, TCQ, Form

LADDER_EXTRA_LEVELS = 2  # cheaper levels a cachegen storage ladder adds at most


@dataclass(frozen=True)
class LevelInfo:
    """One form of a codec: ``bits`` (estimated bits per element of a chunk), ``loss_pct``
    (perplexity change, %; None: unknown), ``default`` (the codec's default level, coded),
    ``calibrated`` (a shipped calibrated level: chosen for a measured target)."""

    form: Form
    bits: float
    loss_pct: float | None
    default: bool
    calibrated: bool


class LevelCatalog:
    """The levels of ``codec`` (a made codec) for the model of weights ``fingerprint``, for
    chunks of ``chunk_tokens`` tokens."""

    def __init__(self, codec: Any, fingerprint: str, chunk_tokens: int) -> None:
        self.codec = codec
        self.name = codec.name
        self.fingerprint = fingerprint
        self.chunk_tokens = chunk_tokens
        self._bits: dict[Form, float] = {}

    @property
    def levels(self) -> list[int]:
        return list(self.codec.levels)

    @property
    def default(self) -> Form:
        """The codec's default form: its default level, coded (its one form for a baseline)."""
        if self.name not in LEVELED:
            return Form(self.name)
        return Form(self.name, self.codec.default_level)

    @functools.cached_property
    def calibrated_levels(self) -> list[int]:
        """The shipped calibrated levels (cachegen: the profile's unchanged ones; tcq: those a
        calibration chose for this model file); empty when none."""
        if self.name == CACHEGEN:
            return list(self.codec.profile.calibrated_levels())
        if self.name == TCQ:
            return sorted(self._tcq_targets or {})
        return []

    @functools.cached_property
    def _tcq_targets(self) -> dict[int, float] | None:
        calibration = self.codec.calibrated_levels() if self.name == TCQ else None
        return calibration["targets"] if calibration else None

    def forms(self, level: int | None) -> list[Form]:
        """The forms of ``level`` (coded, then packed where the codec has it)."""
        if self.name not in LEVELED:
            return [Form(self.name)]
        return [Form(self.name, level, packing) for packing in (CODED, PACKED)]

    def bits(self, form: Form) -> float:
        """Estimated bits per element of ``form``'s record of a chunk."""
        if form not in self._bits:
            level, packing = form.level, form.packing
            self._bits[form] = self.codec.estimated_bits(level, self.chunk_tokens, packing)
        return self._bits[form]

    def loss_pct(self, form: Form) -> float | None:
        """``form``'s measured quality loss (None: unknown; ``cachegen.codec.form_loss``)."""
        return self._losses([form.label])[form.label]

    def _losses(self, names: Sequence[str]) -> dict[str, float | None]:
        calibrated = self.calibrated_levels if self.name == CACHEGEN else None
        return form_losses(names, self.fingerprint, calibrated, self._tcq_targets)

    def info(self, form: Form) -> LevelInfo:
        return LevelInfo(
            form,
            self.bits(form),
            self.loss_pct(form),
            form == self.default,
            form.level in self.calibrated_levels,
        )

    def entries(self) -> list[LevelInfo]:
        """Every form of every level, coded before packed, in level order."""
        levels = self.levels if self.name in LEVELED else [None]
        return [self.info(form) for level in levels for form in self.forms(level)]

    def cachegen_ladder(self, budget: float, cheaper: bool) -> list[Form]:
        """cachegen's default storage ladder within ``budget`` bits per element: the default
        level coded, its packed form when both fit, and with ``cheaper`` up to two cheaper
        levels (:func:`storage_ladder`, beside the coded default alone), picked among the
        shipped calibrated levels when there are any, else among all."""
        default = self.codec.default_level
        pool = self.calibrated_levels or self.levels
        bits = {lv: self.bits(Form(CACHEGEN, lv)) for lv in {*pool, default}}
        extra = storage_ladder(default, bits, budget)[1:] if cheaper else []
        ladder = [Form(CACHEGEN, default), *(Form(CACHEGEN, lv) for lv in extra)]
        if bits[default] + self.bits(Form(CACHEGEN, default, PACKED)) <= budget:
            ladder.insert(1, Form(CACHEGEN, default, PACKED))
        return ladder


def tcq_ladder(tcq: LevelCatalog, cachegen: LevelCatalog, budget: float) -> list[Form]:
    """tcq's default storage ladder (:func:`tcq_storage_ladder`): its default level coded,
    then cachegen's default level packed (the fastest form to decode), else tcq's default
    level packed, whichever fits first within ``budget`` beside it."""
    default = tcq.default
    fast = [Form(CACHEGEN, cachegen.codec.default_level, PACKED), Form(TCQ, default.level, PACKED)]
    catalogs = {TCQ: tcq, CACHEGEN: cachegen}
    bits = {form: catalogs[form.codec].bits(form) for form in (default, *fast)}
    return tcq_storage_ladder(default, fast, bits, budget)


def storage_ladder(default: int, bits: dict[int, float], budget: float) -> list[int]:
    """The levels to store per chunk: ``default`` first, then up to two levels of ``bits``
    (estimated bits/element per level) cheaper than it, while the sum stays within ``budget``:
    the cheapest level (the form for the slowest links), then the level nearest the midpoint
    between it and the default that still fits. Deterministic: ties go to the lower level."""
    ladder = [default]
    left = budget - bits[default]
    cheaper = sorted((b, lv) for lv, b in bits.items() if lv != default and b < bits[default])
    if not cheaper or cheaper[0][0] > left:
        return ladder
    low_bits, low = cheaper[0]
    ladder.append(low)
    left -= low_bits
    middle = (bits[default] + low_bits) / 2
    between = sorted((abs(b - middle), lv, b) for b, lv in cheaper[1:])
    for _, lv, b in between:
        if len(ladder) == 1 + LADDER_EXTRA_LEVELS:
            break
        if b <= left:
            ladder.append(lv)
            left -= b
    return ladder


def tcq_storage_ladder(
    default: Form,
    fast: Sequence[Form],
    bits: Mapping[Form, float],
    budget: float,
) -> list[Form]:
    """The forms to store per chunk: ``default`` first, then the first of ``fast`` (in order of
    preference) whose estimated bits/element (``bits``) fit ``budget`` beside it, if any."""
    left = budget - bits[default]
    chosen = next((form for form in fast if bits[form] <= left), None)
    return [default] if chosen is None else [default, chosen]
