"""One place per (model, codec) that knows its levels: cachegen.codec.catalog.LevelCatalog."""

from __future__ import annotations

import json

import pytest

from cachegen.codec import form_loss
from cachegen.codec.cachegen.profile import SHIPPED_DIR
from cachegen.codec.catalog import LevelCatalog, storage_ladder, tcq_ladder, tcq_storage_ladder
from cachegen.modes import CACHEGEN, PACKED, TCQ, Form
from cachegen.profiles import codec_for

CHUNK = 256


@pytest.fixture(scope="module")
def catalogs(smollm2) -> dict[str, LevelCatalog]:
    fingerprint = smollm2.identity().fingerprint
    return {
        name: LevelCatalog(codec_for(name, smollm2, chunk_tokens=CHUNK), fingerprint, CHUNK)
        for name in (CACHEGEN, TCQ, "int8")
    }


def test_a_cachegen_catalog_holds_each_levels_size_loss_default_and_calibration(catalogs):
    catalog = catalogs[CACHEGEN]
    shipped = json.loads((SHIPPED_DIR / "smollm2-135m.json").read_text())
    default = shipped["default_level"]
    assert catalog.default == Form(CACHEGEN, default)
    assert catalog.calibrated_levels == sorted(int(lv) for lv in shipped["levels"])
    entries = {info.form: info for info in catalog.entries()}
    assert set(entries) == {
        Form(CACHEGEN, lv, packing) for lv in catalog.levels for packing in ("coded", PACKED)
    }
    coded, packed = entries[Form(CACHEGEN, default)], entries[Form(CACHEGEN, default, PACKED)]
    target = shipped["levels"][str(default)]["target_ppl_pct"]
    assert (coded.loss_pct, packed.loss_pct) == (target, target)  # the same KV
    assert coded.default and coded.calibrated and not packed.default
    assert coded.bits == catalog.codec.estimated_bits(default, CHUNK) < packed.bits
    assert entries[Form(CACHEGEN, 1)].loss_pct is None  # a preset: no measured loss


def test_a_baselines_catalog_has_one_form(catalogs):
    (info,) = catalogs["int8"].entries()
    measured = json.loads(form_loss.LOSS_FILE.read_text())["models"]["smollm2-135m"]["loss_pct"]
    assert (info.form, info.default, info.loss_pct) == (Form("int8"), True, measured["int8"])


def test_the_storage_ladders_come_from_the_catalogs(catalogs):
    cachegen, tcq = catalogs[CACHEGEN], catalogs[TCQ]
    default = cachegen.codec.default_level
    assert cachegen.cachegen_ladder(7.95, cheaper=False) == [
        Form(CACHEGEN, default),
        Form(CACHEGEN, default, PACKED),
    ]
    assert cachegen.cachegen_ladder(cachegen.bits(Form(CACHEGEN, default)), False) == [
        Form(CACHEGEN, default)  # no room for the packed form beside it
    ]
    assert tcq_ladder(tcq, cachegen, 6.35) == [tcq.default, Form(CACHEGEN, default, PACKED)]


def test_storage_ladder_picks_the_cheapest_then_the_midpoint():
    bits = {4: 4.0, 1: 1.0, 2: 2.0, 3: 3.0}
    assert storage_ladder(4, bits, 8.0) == [4, 1, 2]  # 2.5 is the midpoint: 2 wins the tie
    assert storage_ladder(4, bits, 4.5) == [4]  # the cheapest does not fit
    fast = [Form(CACHEGEN, 4, PACKED), Form(TCQ, 22, PACKED)]
    sizes = {Form(TCQ, 22): 2.0, fast[0]: 5.0, fast[1]: 3.0}
    assert tcq_storage_ladder(Form(TCQ, 22), fast, sizes, 6.0) == [Form(TCQ, 22), fast[1]]
