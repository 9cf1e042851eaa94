"""The vocabulary of modes and stored forms (cachegen.modes)."""

from __future__ import annotations

import pytest

from cachegen.codec import get_codec
from cachegen.errors import InputError
from cachegen.modes import CODED, KV_BASELINES, LEVEL_LIMIT, PACKED, Form, Mode, configured_form
from cachegen.store.address import form_at, slot_of

LABELS = {
    "cachegen-11": Form("cachegen", 11),
    "cachegen-11-packed": Form("cachegen", 11, PACKED),
    "cachegen-0": Form("cachegen", 0),
    "tcq-21": Form("tcq", 21),
    "tcq-24-packed": Form("tcq", 24, PACKED),
    "raw": Form("raw"),
    "int8": Form("int8"),
    "fp8": Form("fp8"),
}


@pytest.mark.parametrize("label", LABELS)
def test_a_form_label_parses_and_prints_back(label):
    form = Form.parse(label)
    assert form == LABELS[label] and form.label == label
    assert form_at(form.codec, slot_of(form)) == form
    assert form.coded == Form(form.codec, form.level, CODED)


@pytest.mark.parametrize("codec", ["cachegen", "tcq"])
def test_a_packed_slot_is_its_level_with_bit_15_set(codec):
    """How a store lays a form out (cachegen.store.address, private to the store)."""
    assert LEVEL_LIMIT == 1 << 15
    assert slot_of(Form(codec, 4)) == 4 and slot_of(Form(codec, 4, PACKED)) == 0x8004
    for level in (0, 4, 24, LEVEL_LIMIT - 1):
        for packing in (CODED, PACKED):
            form = Form(codec, level, packing)
            assert form_at(codec, slot_of(form)) == form
    assert Form.parse(f"{codec}-11-packed").coded.label == f"{codec}-11"


@pytest.mark.parametrize("codec", KV_BASELINES)
def test_a_baseline_is_stored_at_its_codecs_one_level(codec):
    assert slot_of(Form(codec)) == get_codec(codec).default_level == 0
    with pytest.raises(Exception, match="one form"):
        form_at(codec, 4)


@pytest.mark.parametrize("codec", ["cachegen", "tcq"])
def test_a_configuration_names_a_level_or_a_form_never_a_slot(codec):
    assert configured_form(4, codec) == Form(codec, 4)
    assert configured_form(f"{codec}-4-packed", codec) == Form(codec, 4, PACKED)
    with pytest.raises(InputError, match=f"write the form '{codec}-4-packed' instead"):
        configured_form(LEVEL_LIMIT | 4, codec)
    with pytest.raises(InputError, match="is not a form of"):
        configured_form("int8", codec)


@pytest.mark.parametrize(
    "label",
    [
        "cachegen-x",
        "cachegen-2-coded",
        "tcq-packed",
        "tcq-3-packed-packed",
        "raw-packed",
        "recompute",
        "adaptive",
        "",
    ],
)
def test_a_bad_label_is_refused_naming_the_forms(label):
    with pytest.raises(InputError) as info:
        Form.parse(label)
    message = str(info.value)
    assert f"unknown form {label!r}" in message
    assert "cachegen-<L>, cachegen-<L>-packed, tcq-<L>, tcq-<L>-packed, raw, int8, fp8" in message


@pytest.mark.parametrize(
    "args, message",
    [
        (("cachegen", LEVEL_LIMIT), "out of range"),
        (("cachegen", -1), "out of range"),
        (("int8", None, PACKED), "only cachegen and tcq levels do"),
        (("tcq", LEVEL_LIMIT, PACKED), "out of range"),
        (("cachegen", 4, "zipped"), "unknown form 'zipped'"),
        (("cachegen",), "names its level"),
        (("int8", 0), "one level"),
    ],
)
def test_a_form_no_store_holds_is_refused(args, message):
    with pytest.raises(InputError, match=message):
        Form(*args)


def test_a_fixed_mode_names_the_form_it_stores():
    assert Mode.parse("cachegen-11").form == Form("cachegen", 11)
    assert Mode.parse("tcq-21").form == Form("tcq", 21)
    assert Mode.parse("int8").form == Form("int8")
    assert Mode.parse("recompute").form is None and Mode.parse("adaptive").form is None
    with pytest.raises(InputError, match="unknown mode"):
        Mode.parse("cachegen-11-packed")
