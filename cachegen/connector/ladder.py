"""Which levels the connector stores per chunk and which a load may use.

The ladder of a chunk is the list of its stored levels (a level's packed form is its store
slot, ``cachegen.modes.Form.slot``: the level with bit 15 set, stored and requested like a
level). It is chosen once per transport from the codec profile and the tcq model file alone,
so that every engine of a store writes and reads the same ladder. tcq's default ladder may hold
a form of another codec, cachegen's packed default level, stored under cachegen's keys.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from cachegen.connector.codecs import codec_name
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.errors import InputError
from cachegen.modes import ADAPTIVE, CACHEGEN, CODED, PACKED, TCQ, Form

if TYPE_CHECKING:
    from cachegen.connector.codecs import CodecSet

# Sum of the ladder's estimated bits/element: half of bf16's 16 bits, less headroom for what the
# estimate leaves out (headers, frame token ids); the tables' estimate runs above real KV's
# payload for the shipped defaults (docs/connector.md, "Storage cost").
LADDER_BUDGET_BITS = 8.0
LADDER_HEADROOM_BITS = 0.05
LADDER_EXTRA_LEVELS = 2
# tcq's default ladder (its default level coded, then one fast form) within 0.4 of bf16's 16
# bits, less the same headroom: the coded level alone costs far less than cachegen's.
TCQ_LADDER_BUDGET_BITS = 6.4


class LevelPolicy:
    """The levels of each mode: stored (:meth:`levels`, and per codec for a save of several
    modes, :meth:`stored_slots`), written first (:meth:`first_levels`), needed by a load
    (:meth:`load_levels`, under the keys of :meth:`lookup_codec`), chosen from by ``adaptive``
    (:attr:`adaptive_levels`; with ``max_loss_pct``, :attr:`form_slots`), and each stored
    form's quality loss (:attr:`form_loss_pct`)."""

    def __init__(self, codecs: CodecSet, config: ConnectorConfig, fingerprint: str) -> None:
        self.codecs = codecs
        self.config = config
        self.fingerprint = fingerprint  # the model's, for its measured form losses

    def levels(self, mode: str) -> list[int]:
        """The levels of ``mode``'s codec stored for ``mode``: ``cachegen_levels`` when set, else
        (``cachegen`` and ``adaptive``) the :attr:`default_ladder`; for ``tcq`` ``tcq_levels``,
        else those of the :attr:`tcq_ladder`; the one level of the other codecs. A level's
        packed form is its store slot: stored and requested like a level."""
        codec = self.codecs.get(mode)
        if mode == TCQ:
            return self._tcq_levels(codec)
        if mode not in ("cachegen", "adaptive"):
            return list(codec.levels)
        chosen = self.config.cachegen_levels
        if chosen is None:
            return list(self.default_ladder)
        forms = {lv: _form(CACHEGEN, lv) for lv in chosen}
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
        chosen = self.config.tcq_levels
        if chosen is None:
            return [form.slot for form in self.tcq_ladder if form.codec == TCQ]
        forms = {lv: _form(TCQ, lv) for lv in chosen}
        unknown = sorted(lv for lv, f in forms.items() if f is None or f.level not in codec.levels)
        if unknown:
            raise ConnectorError(
                f"tcq_levels {unknown} are not levels of this model's tcq model "
                f"{list(codec.levels)} (nor their packed forms, level | 32768)"
            )
        return list(dict.fromkeys(chosen))

    @functools.cached_property
    def tcq_ladder(self) -> list[Form]:
        """The forms stored per chunk for ``tcq`` when ``tcq_levels`` is not set: the tcq
        default level, coded, then one fast form (:func:`tcq_storage_ladder`): cachegen's
        default level packed (stored under cachegen's keys: the fastest form to decode), else
        the tcq default level packed, whichever fits first within 0.4 of the raw bf16 KV
        beside the coded level; else nothing more. Found once per transport, from the tcq model
        file and the cachegen profile alone."""
        tcq, cachegen = self.codecs.get(TCQ), self.codecs.get(CACHEGEN)
        default = Form(TCQ, tcq.default_level)
        fast = [Form(CACHEGEN, cachegen.default_level, PACKED), Form(TCQ, default.level, PACKED)]
        bits = {form: self._estimated_bits(form) for form in (default, *fast)}
        return tcq_storage_ladder(
            default, fast, bits, TCQ_LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        )

    def _estimated_bits(self, form: Form) -> float:
        codec = self.codecs.get(form.codec)
        return codec.estimated_bits(form.level, self.config.chunk_tokens, form.packing)

    def borrowed(self, mode: str) -> list[Form]:
        """The forms of other codecs that ``mode``'s ladder stores (under their own codec's
        keys): the fast form of the :attr:`tcq_ladder` when it is cachegen's."""
        if mode != TCQ or self.config.tcq_levels is not None:
            return []
        return [form for form in self.tcq_ladder if form.codec != TCQ]

    def stored_slots(self, modes: Iterable[str]) -> dict[str, list[int]]:
        """The store slots a save of ``modes`` writes, per codec (``adaptive``'s are
        cachegen's): each mode's :meth:`levels`, then the forms their ladders borrow from
        another codec (:meth:`borrowed`)."""
        modes = list(modes)
        slots: dict[str, list[int]] = {}
        for mode in modes:
            slots.setdefault(codec_name(mode), []).extend(self.levels(mode))
        for mode in modes:
            for form in self.borrowed(mode):
                slots.setdefault(form.codec, []).append(form.slot)
        return {codec: list(dict.fromkeys(levels)) for codec, levels in slots.items()}

    def first_slots(self, modes: Iterable[str]) -> dict[str, list[int]]:
        """The store slots of :meth:`stored_slots` a save of ``modes`` writes first, per codec:
        each mode's :meth:`first_levels` (a borrowed form never is)."""
        first: dict[str, list[int]] = {}
        for mode in modes:
            first.setdefault(codec_name(mode), []).extend(self.first_levels(mode))
        return first

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

    def lookup_codec(self, options: RequestOptions) -> str:
        """The codec under whose keys a chunk is found for ``options``: its mode's (cachegen's
        for ``adaptive``), but tcq's for ``adaptive`` with ``max_loss_pct`` on an engine whose
        saves write tcq and no cachegen level (tcq's default ladder), where a chunk is loadable
        once its tcq default level is stored."""
        saved = {codec_name(mode) for mode in self.config.save_modes}
        bounded = options.mode == ADAPTIVE and options.max_loss_pct is not None
        if bounded and TCQ in saved and CACHEGEN not in saved:
            return TCQ
        return codec_name(options.mode)

    def load_levels(self, options: RequestOptions) -> list[int]:
        """Levels a chunk must be stored at to be loadable with ``options``: for ``adaptive``
        the first of :attr:`adaptive_levels` (written in a save's first pass), or with
        tcq's keys (:meth:`lookup_codec`) tcq's first level; it chooses among the forms each
        chunk is stored in. ``options.level`` may name a stored level's packed form (its store
        slot, :meth:`levels`); the default level loads coded."""
        if options.mode == ADAPTIVE:
            if self.lookup_codec(options) == TCQ:
                return self.first_levels(TCQ)[:1]
            return self.adaptive_levels[:1]
        codec = self.codecs.get(options.mode)
        level = codec.default_level if options.level is None else options.level
        if level not in self.levels(options.mode):
            raise ConnectorError(
                f"{options.mode} stores levels {self.levels(options.mode)}, not {level}"
            )
        return [level]

    @functools.cached_property
    def form_slots(self) -> dict[str, list[int]]:
        """The forms ``adaptive`` with ``max_loss_pct`` may load, as store slots per codec:
        cachegen's ladder (any engine of the store may have written it), and every form the
        saves of this engine write (:meth:`stored_slots` of ``save_modes``)."""
        slots = {CACHEGEN: self.levels(CACHEGEN)}
        for codec, more in self.stored_slots(self.config.save_modes).items():
            slots[codec] = list(dict.fromkeys([*slots.get(codec, []), *more]))
        return slots

    @functools.cached_property
    def form_loss_pct(self) -> dict[str, float | None]:
        """The quality loss (perplexity change, %; None: unknown) of each form of
        :attr:`form_slots` (``cachegen.codec.form_loss``)."""
        names = [
            Form.from_slot(codec, slot).label
            for codec, slots in self.form_slots.items()
            for slot in slots
        ]
        tcq_targets = None
        if TCQ in self.form_slots:
            calibration = self.codecs.get(TCQ).calibrated_levels()
            tcq_targets = calibration["targets"] if calibration else None
        calibrated = self.codecs.get(CACHEGEN).profile.calibrated_levels()
        from cachegen.codec.form_loss import form_losses  # the codec loads numba: not at import

        return form_losses(names, self.fingerprint, calibrated, tcq_targets)


def _form(codec: str, slot: int) -> Form | None:
    """The form of ``codec`` a configured level names; None for a number that is no store
    slot."""
    try:
        return Form.from_slot(codec, slot)
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


def tcq_storage_ladder(
    default: Form,
    fast: Sequence[Form],
    bits: Mapping[Form, float],
    budget: float,
) -> list[Form]:
    """The forms to store per chunk: ``default`` first, then the first of ``fast`` (in order of
    preference) whose estimated bits/element (``bits``) fit ``budget`` beside it, if any (the
    connector's budget: ``TCQ_LADDER_BUDGET_BITS`` less ``LADDER_HEADROOM_BITS``)."""
    left = budget - bits[default]
    chosen = next((form for form in fast if bits[form] <= left), None)
    return [default] if chosen is None else [default, chosen]
