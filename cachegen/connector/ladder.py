"""Which forms the connector stores per chunk and which a load may use.

The ladder of a chunk is the list of its stored forms (``cachegen.modes.Form``: a level of a
codec, coded or packed). It is chosen once per engine from what each codec's
``cachegen.codec.catalog.LevelCatalog`` knows of its levels (sizes, losses, default), so that
every engine of a store writes and reads the same ladder. tcq's default ladder may hold a form
of another codec, cachegen's packed default level, stored under cachegen's keys.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from cachegen.connector.codecs import codec_name
from cachegen.connector.config import ConnectorConfig, RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.modes import ADAPTIVE, CACHEGEN, CODED, PACKED, TCQ, Form, configured_form

if TYPE_CHECKING:
    from cachegen.connector.codecs import CodecSet

# Sum of the ladder's estimated bits/element: half of bf16's 16 bits, less headroom for what the
# estimate leaves out (headers, frame token ids); the tables' estimate runs above real KV's
# payload for the shipped defaults (docs/connector.md, "Storage cost").
LADDER_BUDGET_BITS = 8.0
LADDER_HEADROOM_BITS = 0.05
# tcq's default ladder (its default level coded, then one fast form) within 0.4 of bf16's 16
# bits, less the same headroom: the coded level alone costs far less than cachegen's.
TCQ_LADDER_BUDGET_BITS = 6.4


class LevelPolicy:
    """The forms of each mode: stored (:meth:`forms`, and per codec for a save of several
    modes, :meth:`stored_forms`), written first (:meth:`first_forms`), needed by a load
    (:meth:`load_forms`, under the keys of :meth:`lookup_codec`), chosen from by ``adaptive``
    (:attr:`adaptive_levels`; with ``max_loss_pct``, :attr:`loadable_forms`), and each stored
    form's quality loss (:attr:`form_loss_pct`)."""

    def __init__(self, codecs: CodecSet, config: ConnectorConfig, fingerprint: str) -> None:
        self.codecs = codecs
        self.config = config
        self.fingerprint = fingerprint  # the model's, for its measured form losses

    def forms(self, mode: str) -> list[Form]:
        """The forms stored for ``mode``, of its codec: ``cachegen_levels`` when set, else
        (``cachegen`` and ``adaptive``) the :attr:`default_ladder`; for ``tcq`` ``tcq_levels``,
        else those of the :attr:`tcq_ladder`; the one form of the other codecs."""
        codec = self.codecs.get(mode)
        if mode == TCQ:
            return self._tcq_forms(codec)
        if mode not in (CACHEGEN, ADAPTIVE):
            return [Form(codec_name(mode))]
        chosen = self.config.cachegen_levels
        if chosen is None:
            return list(self.default_ladder)
        forms = _configured(CACHEGEN, chosen, codec, "cachegen_levels", "profile")
        if all(f.packing == PACKED for f in forms):
            raise ConnectorError(
                f"cachegen_levels {list(chosen)} hold only packed forms; add a coded level "
                "(adaptive loads and ranks coded levels)"
            )
        return forms

    def _tcq_forms(self, codec: Any) -> list[Form]:
        chosen = self.config.tcq_levels
        if chosen is None:
            return [form for form in self.tcq_ladder if form.codec == TCQ]
        return _configured(TCQ, chosen, codec, "tcq_levels", "tcq model")

    @functools.cached_property
    def tcq_ladder(self) -> list[Form]:
        """The forms stored per chunk for ``tcq`` when ``tcq_levels`` is not set: the tcq
        default level, coded, then one fast form (``cachegen.codec.catalog.tcq_ladder``):
        cachegen's default level packed (stored under cachegen's keys: the fastest form to
        decode), else the tcq default level packed, whichever fits first within 0.4 of the raw
        bf16 KV beside the coded level; else nothing more. Found once per engine, from the tcq
        model file and the cachegen profile alone."""
        from cachegen.codec.catalog import tcq_ladder  # the codec loads numba: not at import

        budget = TCQ_LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        return tcq_ladder(self.codecs.catalog(TCQ), self.codecs.catalog(CACHEGEN), budget)

    def borrowed(self, mode: str) -> list[Form]:
        """The forms of other codecs that ``mode``'s ladder stores (under their own codec's
        keys): the fast form of the :attr:`tcq_ladder` when it is cachegen's."""
        if mode != TCQ or self.config.tcq_levels is not None:
            return []
        return [form for form in self.tcq_ladder if form.codec != TCQ]

    def stored_forms(self, modes: Iterable[str]) -> dict[str, list[Form]]:
        """The forms a save of ``modes`` writes, per codec (``adaptive``'s are cachegen's):
        each mode's :meth:`forms`, then the forms their ladders borrow from another codec
        (:meth:`borrowed`)."""
        modes = list(modes)
        forms: dict[str, list[Form]] = {}
        for mode in modes:
            forms.setdefault(codec_name(mode), []).extend(self.forms(mode))
        for mode in modes:
            for form in self.borrowed(mode):
                forms.setdefault(form.codec, []).append(form)
        return {codec: list(dict.fromkeys(stored)) for codec, stored in forms.items()}

    def first_forms(self, modes: Iterable[str]) -> dict[str, list[Form]]:
        """The forms of :meth:`stored_forms` a save of ``modes`` writes first, per codec:
        each mode's :meth:`first_of` (a borrowed form never is)."""
        first: dict[str, list[Form]] = {}
        for mode in modes:
            first.setdefault(codec_name(mode), []).extend(self.first_of(mode))
        return first

    @functools.cached_property
    def default_ladder(self) -> list[Form]:
        """The cachegen forms stored per chunk when ``cachegen_levels`` is not set: the codec's
        default level first, coded, then packed (loads that decode at memory speed) when both fit
        within half the raw bf16 KV. When ``adaptive`` is among the ``save_modes``, at most two
        cheaper levels follow, those ``cachegen.codec.catalog.storage_ladder`` picks within half the
        raw KV beside the coded default alone (so ``adaptive`` has a ladder; its cost is documented
        per configuration in docs/connector.md). Levels are picked from the model's shipped
        calibrated levels when it has them, else from all.

        The controller ranks levels by their bytes, which only orders quality along a frontier: on
        SmolLM2 the paper's level 3 is slightly larger than calibrated level 4 at several times its
        perplexity change (docs/connector.md); the calibrated levels were each chosen for a measured
        perplexity target and together dominate the presets (docs/quality.md). Found once per
        engine: the scheduler asks on every lookup."""
        budget = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        cheaper = ADAPTIVE in self.config.save_modes
        return self.codecs.catalog(CACHEGEN).cachegen_ladder(budget, cheaper)

    @functools.cached_property
    def adaptive_levels(self) -> list[int]:
        """The cachegen levels ``adaptive`` chooses from: the stored coded levels
        (``cachegen_levels`` when set, else the :attr:`default_ladder`) that are shipped
        calibrated levels, or every stored coded level when none is (the controller would
        trade a dominated preset for a few bytes). Coded forms only: the controller ranks
        levels by their bytes."""
        stored = [f.level for f in self.forms(ADAPTIVE) if f.packing == CODED]
        calibrated = set(self.codecs.catalog(CACHEGEN).calibrated_levels)
        return [lv for lv in stored if lv in calibrated] or stored

    def first_of(self, mode: str) -> list[Form]:
        """The forms of ``mode`` a save writes first, for every chunk, before the others: those
        a request that names no level needs (the codec's default level, and the level that
        makes a chunk loadable for ``adaptive``), so the chunks become loadable soonest."""
        stored = self.forms(mode)
        needed = {self.codecs.catalog(mode).default}
        if mode in (CACHEGEN, ADAPTIVE):
            needed.add(Form(CACHEGEN, self.adaptive_levels[0]))
        return [form for form in stored if form in needed] or stored[:1]

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

    def load_forms(self, options: RequestOptions) -> list[Form]:
        """Forms a chunk must be stored in to be loadable with ``options``: for ``adaptive``
        the first of :attr:`adaptive_levels` (written in a save's first pass), or with
        tcq's keys (:meth:`lookup_codec`) tcq's first form; it chooses among the forms each
        chunk is stored in. Else the form ``options`` names (``form``, or ``level``: coded;
        the codec's default level when neither is given)."""
        if options.mode == ADAPTIVE:
            if self.lookup_codec(options) == TCQ:
                return self.first_of(TCQ)[:1]
            return [Form(CACHEGEN, self.adaptive_levels[0])]
        if options.form is not None:
            form = Form.parse(options.form)
        elif options.level is None:
            form = self.codecs.catalog(options.mode).default
        else:  # a level of a codec of one level other than 0 is refused here
            form = configured_form(options.level, codec_name(options.mode))
        stored = self.forms(options.mode)
        if form not in stored:
            names = [f.label for f in stored]
            raise ConnectorError(f"{options.mode} stores the forms {names}, not {form.label}")
        return [form]

    @functools.cached_property
    def loadable_forms(self) -> dict[str, list[Form]]:
        """The forms ``adaptive`` with ``max_loss_pct`` may load, per codec: cachegen's ladder
        (any engine of the store may have written it), and every form the saves of this
        engine write (:meth:`stored_forms` of ``save_modes``)."""
        forms = {CACHEGEN: self.forms(CACHEGEN)}
        for codec, more in self.stored_forms(self.config.save_modes).items():
            forms[codec] = list(dict.fromkeys([*forms.get(codec, []), *more]))
        return forms

    @functools.cached_property
    def form_loss_pct(self) -> dict[str, float | None]:
        """The quality loss (perplexity change, %; None: unknown) of each form of
        :attr:`loadable_forms`, by name (its codec's ``LevelCatalog``)."""
        return {
            form.label: self.codecs.catalog(codec).loss_pct(form)
            for codec, forms in self.loadable_forms.items()
            for form in forms
        }


def _configured(
    codec_name_: str, chosen: Sequence[str], codec: Any, option: str, what: str
) -> list[Form]:
    """The forms a configured list of form names (``cachegen_levels``, ``tcq_levels``)
    names, each a level of ``codec``."""
    forms = [configured_form(name, codec_name_) for name in chosen]
    unknown = sorted(f.label for f in forms if f.level not in codec.levels)
    if unknown:
        raise ConnectorError(
            f"{option} {unknown} are not levels of this model's {what} {list(codec.levels)}"
        )
    return list(dict.fromkeys(forms))
