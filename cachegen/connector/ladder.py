"""Which levels the connector stores per chunk and which a load may use.

The ladder of a chunk is the list of its stored levels (a cachegen level's packed form is its
store slot, ``cachegen.modes.Form.slot``: the level with bit 15 set, stored and requested like
a level). It is chosen once per transport from the codec profile alone, so
that every engine of a store writes and reads the same ladder.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from cachegen.codec.form_loss import form_losses
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.errors import InputError
from cachegen.modes import CACHEGEN, CODED, KV_BASELINES, PACKED, TCQ, Form

if TYPE_CHECKING:
    from cachegen.connector.codecs import CodecSet

# Sum of the ladder's estimated bits/element: half of bf16's 16 bits, less headroom for what the
# estimate leaves out (headers, frame token ids); the tables' estimate runs above real KV's
# payload for the shipped defaults (docs/connector.md, "Storage cost").
LADDER_BUDGET_BITS = 8.0
LADDER_HEADROOM_BITS = 0.05
LADDER_EXTRA_LEVELS = 2


class LevelPolicy:
    """The levels of each mode: stored (:meth:`levels`), written first (:meth:`first_levels`),
    needed by a load (:meth:`load_levels`), chosen from by ``adaptive``
    (:attr:`adaptive_levels`), and each stored form's quality loss (:attr:`form_loss_pct`)."""

    def __init__(self, codecs: CodecSet, config: ConnectorConfig, fingerprint: str) -> None:
        self.codecs = codecs
        self.config = config
        self.fingerprint = fingerprint  # the model's, for its measured form losses

    def levels(self, mode: str) -> list[int]:
        """The levels stored for ``mode``: ``cachegen_levels`` when set, else (``cachegen`` and
        ``adaptive``) the :attr:`default_ladder`; for ``tcq`` ``tcq_levels``, else its default
        level; the one level of the other codecs. A cachegen level's packed form is its store
        slot: stored and requested like a level."""
        codec = self.codecs.get(mode)
        if mode == TCQ:
            return self._tcq_levels(codec)
        if mode not in ("cachegen", "adaptive"):
            return list(codec.levels)
        chosen = self.config.cachegen_levels
        if chosen is None:
            return list(self.default_ladder)
        forms = {lv: _cachegen_form(lv) for lv in chosen}
        unknown = sorted(lv for lv, f in forms.items() if f is None or f.level not in codec.levels)
        if unknown:
            raise ConnectorError(
                f"cachegen_levels {unknown} are not levels of this model's profile "
                f"{list(codec.levels)} (nor their packed forms, level | 32768)"
            )
        if all(f.packing == PACKED for f in forms.values()):
            raise ConnectorError(
                f"cachegen_levels {list(chosen)} hold only packed forms; add a coded level "
                "(adaptive loads and ranks coded levels)"
            )
        return list(chosen)

    def _tcq_levels(self, codec: Any) -> list[int]:
        chosen = self.config.tcq_levels or (codec.default_level,)
        unknown = sorted(set(chosen) - set(codec.levels))
        if unknown:
            raise ConnectorError(
                f"tcq_levels {unknown} are not levels of this model's tcq model "
                f"{list(codec.levels)}"
            )
        return list(dict.fromkeys(chosen))

    @functools.cached_property
    def default_ladder(self) -> list[int]:
        """The cachegen levels stored per chunk when ``cachegen_levels`` is not set: the codec's
        default level first, coded, then in its packed form (its store slot: loads that decode
        at memory speed) when both fit within half the raw bf16 KV. When ``adaptive`` is among
        the ``save_modes``, at most two cheaper levels follow, those :func:`storage_ladder`
        picks within half the raw KV beside the coded default alone (so ``adaptive`` has a
        ladder; its cost is documented per configuration in docs/connector.md). Levels are
        picked from the model's shipped calibrated levels when it has them, else from all.

        The controller ranks levels by their bytes, which only orders quality along a frontier:
        on SmolLM2 the paper's level 3 is slightly larger than calibrated level 4 at several
        times its perplexity change (docs/connector.md); the calibrated levels were each chosen
        for a measured perplexity target and together dominate the presets (docs/quality.md).
        Found once per transport: the scheduler asks on every lookup."""
        codec = self.codecs.get("cachegen")
        chunk_tokens = self.config.chunk_tokens
        pool = codec.profile.calibrated_levels() or list(codec.levels)
        default = codec.default_level
        bits = {lv: codec.estimated_bits(lv, chunk_tokens) for lv in {*pool, default}}
        budget = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        cheaper = (
            storage_ladder(default, bits, budget)[1:]
            if "adaptive" in self.config.save_modes
            else []
        )
        packed = codec.estimated_bits(default, chunk_tokens, PACKED)
        if bits[default] + packed > budget:  # a default too large to store in both forms
            return [default, *cheaper]
        return [default, Form(CACHEGEN, default, PACKED).slot, *cheaper]

    @functools.cached_property
    def adaptive_levels(self) -> list[int]:
        """The levels ``adaptive`` chooses from: the stored levels (``cachegen_levels`` when
        set, else the :attr:`default_ladder`) that are shipped calibrated levels, or every stored
        level when none is (the controller would trade a dominated preset for a few bytes). Coded
        forms only: the controller ranks levels by their bytes."""
        forms = [Form.from_slot(CACHEGEN, lv) for lv in self.levels("adaptive")]
        stored = [f.slot for f in forms if f.packing == CODED]
        calibrated = set(self.codecs.get("adaptive").profile.calibrated_levels())
        return [lv for lv in stored if lv in calibrated] or stored

    def first_levels(self, mode: str) -> list[int]:
        """The levels of ``mode`` a save writes first, for every chunk, before the others: those
        a request that names no level needs (the codec's default level, and the level that
        makes a chunk loadable for ``adaptive``), so the chunks become loadable soonest."""
        stored = self.levels(mode)
        needed = {self.codecs.get(mode).default_level}
        if mode in ("cachegen", "adaptive"):
            needed.add(self.adaptive_levels[0])
        return [lv for lv in stored if lv in needed] or stored[:1]

    def load_levels(self, options: RequestOptions) -> list[int]:
        """Levels a chunk must be stored at to be loadable with ``options``: for ``adaptive``
        the first of :attr:`adaptive_levels` (written in a save's first pass); it chooses among
        the adaptive levels each chunk is stored at. ``options.level`` may name a stored level's
        packed form (its store slot, :meth:`levels`); the default level loads coded."""
        if options.mode == "adaptive":
            return self.adaptive_levels[:1]
        codec = self.codecs.get(options.mode)
        level = codec.default_level if options.level is None else options.level
        if level not in self.levels(options.mode):
            raise ConnectorError(
                f"{options.mode} stores levels {self.levels(options.mode)}, not {level}"
            )
        return [level]

    @functools.cached_property
    def form_loss_pct(self) -> dict[str, float | None]:
        """The quality loss (perplexity change, %; None: unknown) of each form this transport
        stores (``cachegen.codec.form_loss``)."""
        save_modes = self.config.save_modes
        names = [Form.from_slot(CACHEGEN, lv).label for lv in self.levels(CACHEGEN)]
        names += [m for m in save_modes if m in KV_BASELINES]
        tcq_targets = None
        if TCQ in save_modes:
            names += [Form.from_slot(TCQ, lv).label for lv in self.levels(TCQ)]
            calibration = self.codecs.get(TCQ).calibrated_levels()
            tcq_targets = calibration["targets"] if calibration else None
        calibrated = self.codecs.get("cachegen").profile.calibrated_levels()
        return form_losses(names, self.fingerprint, calibrated, tcq_targets)


def _cachegen_form(slot: int) -> Form | None:
    """The cachegen form a configured level names; None for a number that is no store slot."""
    try:
        return Form.from_slot(CACHEGEN, slot)
    except InputError:
        return None


def storage_ladder(
    default: int,
    bits: dict[int, float],
    budget: float = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS,
) -> list[int]:
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
