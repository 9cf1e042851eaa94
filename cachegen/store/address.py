"""What names one stored record: :class:`RecordAddress`.

A record is one form of one part of one chunk: its *scope* (the key namespace: model, codec
profile, chunking; ``cachegen.store.keys.namespace``), its chunk's *digest* (the hash chained
over its tokens and every token before them, seeded by the request's key scope), its *part*
(the whole chunk, or for a model that mixes attention kinds its full-attention or its
sliding-window layers) and its *form* (``cachegen.modes.Form``: ``cachegen-11-packed``,
``tcq-22``, ``int8``...). Form names are the only public vocabulary: how a backend lays a form
out in its records (a 16-bit slot beside the key) is private to this package. A scope belongs to
one codec profile (the namespace hashes it), so the slot of a form need not name its codec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cachegen.modes import LEVELED, PACKED, Form
from cachegen.store.errors import StoreConfigError
from cachegen.store.keys import sliding_key, validate_key

FULL, SLIDING = "full", "sliding"  # the parts of a chunk of a model with two kinds of layers
PARTS = (None, FULL, SLIDING)  # None: the whole chunk, one record

_PACKED_BIT = 1 << 15  # a packed form's slot: its level with this bit set


@dataclass(frozen=True)
class RecordAddress:
    """One record: ``scope``/``digest`` name its chunk, ``part`` which of its layers (None:
    all), ``form`` how they are encoded. Made with :meth:`of`."""

    scope: str
    digest: str
    part: str | None
    form: Form

    @classmethod
    def of(cls, chunk_key: str, form: Form | str, part: str | None = None) -> RecordAddress:
        """The record of ``part`` of the chunk ``chunk_key`` (``cachegen.store.chunk_keys``)
        in ``form`` (a ``Form`` or its name)."""
        scope, _, digest = validate_key(chunk_key).partition("/")
        if part not in PARTS:
            raise StoreConfigError(f"unknown part {part!r}; parts are {FULL!r} and {SLIDING!r}")
        return cls(scope, digest, part, Form.parse(form) if isinstance(form, str) else form)

    @property
    def chunk_key(self) -> str:
        return f"{self.scope}/{self.digest}"

    @property
    def key(self) -> str:
        """The backend's key of this record (the sliding part's is the chunk's, suffixed)."""
        return sliding_key(self.chunk_key) if self.part == SLIDING else self.chunk_key

    def with_form(self, form: Form) -> RecordAddress:
        return dataclasses.replace(self, form=form)

    def with_part(self, part: str | None) -> RecordAddress:
        return dataclasses.replace(self, part=part)

    def __str__(self) -> str:
        return f"{self.key} ({self.form.label})"


def slot_of(form: Form) -> int:
    """The 16-bit slot a backend stores ``form``'s records under: the level (0 for a codec of
    one level), with bit 15 set when packed. For the backends only."""
    if form.level is None:
        return 0
    return form.level | _PACKED_BIT if form.packing == PACKED else form.level


def form_at(codec: str, slot: int) -> Form:
    """The form of ``codec`` stored at ``slot`` (the inverse of :func:`slot_of`). For the
    backends and the store's own listings only."""
    if codec not in LEVELED:
        if slot != 0:
            raise StoreConfigError(f"{codec} stores one form, at slot 0, not at {slot}")
        return Form(codec)
    if slot & _PACKED_BIT:
        return Form(codec, slot & ~_PACKED_BIT, PACKED)
    return Form(codec, slot)


def locate(address: RecordAddress) -> tuple[str, int]:
    """The backend's ``(key, slot)`` of ``address``."""
    return address.key, slot_of(address.form)
