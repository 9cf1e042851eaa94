"""The ways a server can get a context's KV: one vocabulary for the CLI, the connector,
results and plots.

  ``recompute``      the engine prefills the whole prompt from its tokens (no KV is loaded)
  ``raw``            16-bit KV as the engine holds it
  ``int8``, ``fp8``  the quantization baselines
  ``cachegen-<L>``   the CacheGen codec at quality level L (the connector takes ``mode``
                     ``cachegen`` plus ``level`` L)
  ``tcq-<L>``        the transform codec ``tcq`` at level L (``mode`` ``tcq`` plus ``level``)
  ``adaptive``       CacheGen with a per-chunk level choice under a load-time budget
  ``adaptive-fastest``  per chunk the fastest stored form within a quality bound (the
                     connector takes ``mode`` ``adaptive`` plus ``max_loss_pct``); the bench
                     measures it over the connector's default save ladder

A fixed mode stores one :class:`Form` per chunk; a level of cachegen or tcq has a second form,
``cachegen-<L>-packed``, ``tcq-<L>-packed``: the same symbols bit-packed (larger, decoded
without the entropy coder, to the same KV).

A process may add codecs of one form to the vocabulary (:func:`join_codec`): codecs
registered outside the library (``cachegen.codecs`` entry points) become modes and forms
there, named by the codec's name. A process that joins none, a server's, has the modes above.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cachegen.errors import InputError

RECOMPUTE = "recompute"
CACHEGEN = "cachegen"
TCQ = "tcq"
LEVELED = (CACHEGEN, TCQ)  # codecs whose modes name a level
ADAPTIVE = "adaptive"
ADAPTIVE_FASTEST = "adaptive-fastest"  # adaptive with max_loss_pct, named apart from slo_ms's
KV_BASELINES = ("raw", "int8", "fp8")
LOSSLESS = ("raw",)  # the forms that hold the engine's KV exactly
CONNECTOR_MODES = (
    *KV_BASELINES,
    CACHEGEN,
    TCQ,
    ADAPTIVE,
)  # the modes that load KV through the connector
MODES = (RECOMPUTE, *CONNECTOR_MODES, ADAPTIVE_FASTEST)

CODED, PACKED = "coded", "packed"
FORMS = (CODED, PACKED)  # how a level's symbols are stored: entropy-coded or bit-packed
_JOINED: dict[str, None] = {}  # codecs of one form this process added (join_codec), in order
LEVEL_LIMIT = 1 << 15  # levels are 0..32767: a store names a form in 16 bits
FORM_LABELS = (
    f"cachegen-<L>, cachegen-<L>-{PACKED}, tcq-<L>, tcq-<L>-{PACKED}, {', '.join(KV_BASELINES)}"
)


def join_codec(name: str) -> None:
    """Make ``name``, a codec of one form (no levels), a mode and a form of this process:
    :meth:`Mode.parse` and :meth:`Form.parse` accept it, and :func:`connector_modes` and
    :func:`all_modes` list it after the library's. Joining again is harmless; a name the
    vocabulary already reads otherwise is refused."""
    if name in _JOINED:
        return
    taken = name in MODES or name.partition("-")[0] in LEVELED or name.endswith(f"-{PACKED}")
    if not name or taken:
        raise InputError(f"{name!r} cannot join the modes: the vocabulary already reads it")
    _JOINED[name] = None


def connector_modes() -> tuple[str, ...]:
    """The modes that load KV through the connector, joined codecs included."""
    return (*CONNECTOR_MODES, *_JOINED)


def all_modes() -> tuple[str, ...]:
    """Every mode, in the vocabulary's order, joined codecs last."""
    return (*MODES, *_JOINED)


@dataclass(frozen=True)
class Form:
    """How one chunk is stored: ``codec``, its ``level`` (None for a codec of one level, the
    baselines) and its ``packing`` (only a level of cachegen or tcq has a packed form)."""

    codec: str
    level: int | None = None
    packing: str = CODED

    def __post_init__(self) -> None:
        if self.packing not in FORMS:
            raise InputError(f"unknown form {self.packing!r}; use {' or '.join(FORMS)}")
        if self.packing == PACKED and self.codec not in LEVELED:
            raise InputError(
                f"{self.codec} has no {PACKED} form; only {' and '.join(LEVELED)} levels do"
            )
        if self.level is None and self.codec in LEVELED:
            raise InputError(f"a {self.codec} form names its level")
        if self.level is not None and self.codec not in LEVELED:
            raise InputError(f"{self.codec} has one level: its form names none")
        if self.level is not None and not 0 <= self.level < LEVEL_LIMIT:
            raise InputError(f"level {self.level} is out of range: levels are 0..{LEVEL_LIMIT - 1}")

    @classmethod
    def parse(cls, label: str) -> Form:
        """``cachegen-<L>``, ``tcq-<L>``, either with ``-packed``, ``raw``, ``int8``, ``fp8``."""
        coded_label = label.removesuffix(f"-{PACKED}")
        try:
            form = Mode.parse(coded_label).form
        except InputError:
            form = None
        if form is None or (coded_label != label and form.codec not in LEVELED):
            joined = "".join(f", {name}" for name in _JOINED)
            raise InputError(f"unknown form {label!r}; forms are {FORM_LABELS}{joined}")
        return form if coded_label == label else dataclasses.replace(form, packing=PACKED)

    @property
    def label(self) -> str:
        if self.level is None:
            return self.codec
        suffix = f"-{PACKED}" if self.packing == PACKED else ""
        return f"{self.codec}-{self.level}{suffix}"

    @property
    def coded(self) -> Form:
        """The coded form of the same symbols (itself when not packed)."""
        return dataclasses.replace(self, packing=CODED)


def configured_form(value: int | str, codec: str) -> Form:
    """The form of ``codec`` that a configuration, a request or a command line names: a level
    (an integer 0..32767) coded, or a form by its name (``cachegen-11-packed``). A number of
    32768 and up (a packed form's store slot in earlier releases) is refused, naming the form
    that replaces it: the form names are the only public vocabulary."""
    if isinstance(value, str):
        form = Form.parse(value)
        if form.codec != codec:
            raise InputError(f"{value!r} is not a form of {codec}")
        return form
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InputError(f"{value!r} is not a level, an integer >= 0")
    if value >= LEVEL_LIMIT:
        name = Form(codec, value & ~LEVEL_LIMIT, PACKED).label if codec in LEVELED else codec
        raise InputError(f"{value} is a store slot, not a level; write the form {name!r} instead")
    if codec not in LEVELED:
        if value != 0:
            raise InputError(f"{codec} has one level, 0, not {value}")
        return Form(codec)
    return Form(codec, value)


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
        """The codec that encodes this mode's KV (None: recompute; the adaptive modes mix
        levels and forms)."""
        return None if self.mode in (RECOMPUTE, ADAPTIVE, ADAPTIVE_FASTEST) else self.mode

    @property
    def connector_mode(self) -> str:
        """The ``mode`` a request names: ``adaptive`` for ``adaptive-fastest`` (which adds
        ``max_loss_pct``), else this mode."""
        return ADAPTIVE if self.mode == ADAPTIVE_FASTEST else self.mode

    @property
    def form(self) -> Form | None:
        """The form this mode stores per chunk (None: recompute, and adaptive, which mixes)."""
        return None if self.codec_name is None else Form(self.codec_name, self.level)

    @classmethod
    def parse(cls, label: str) -> Mode:
        """``recompute``, ``raw``, ``int8``, ``fp8``, ``adaptive``, ``adaptive-fastest``,
        ``cachegen-<level>``, ``tcq-<level>`` or a joined codec (:func:`join_codec`)."""
        if label in all_modes() and label not in LEVELED:
            return cls(label)
        prefix, _, level = label.partition("-")
        if prefix in LEVELED and level.isdigit():
            return cls(prefix, int(level))
        raise InputError(
            f"unknown mode {label!r}; use {', '.join(m for m in all_modes() if m not in LEVELED)}, "
            "cachegen-<level> or tcq-<level>"
        )
