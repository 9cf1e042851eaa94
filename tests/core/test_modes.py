"""The vocabulary of modes and stored forms (cachegen.modes)."""

from __future__ import annotations

import pytest

from cachegen.codec import get_codec
from cachegen.errors import InputError
from cachegen.modes import CODED, KV_BASELINES, PACKED, PACKED_TAG, Form, Mode

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
    assert Form.from_slot(form.codec, form.slot) == form
    assert form.coded == Form(form.codec, form.level, CODED)


@pytest.mark.parametrize("codec", ["cachegen", "tcq"])
def test_a_packed_slot_is_its_level_with_bit_15_set(codec):
    assert PACKED_TAG == 1 << 15
    assert Form(codec, 4).slot == 4 and Form(codec, 4, PACKED).slot == 0x8004
    for level in (0, 4, 24, PACKED_TAG - 1):
        for packing in (CODED, PACKED):
            form = Form(codec, level, packing)
            assert Form.from_slot(codec, form.slot) == form
    assert Form.parse(f"{codec}-11-packed").coded.label == f"{codec}-11"


@pytest.mark.parametrize("codec", KV_BASELINES)
def test_a_baseline_is_stored_at_its_codecs_one_level(codec):
    assert Form(codec).slot == get_codec(codec).default_level == 0
    with pytest.raises(InputError, match="one level"):
        Form.from_slot(codec, 4)


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
        (("cachegen", PACKED_TAG), "no store slot"),
        (("cachegen", -1), "no store slot"),
        (("int8", None, PACKED), "only cachegen and tcq levels do"),
        (("tcq", PACKED_TAG, PACKED), "no store slot"),
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
