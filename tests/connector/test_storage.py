"""What the connector stores by default costs: its save ladders (cachegen's, and tcq's, which
may hold cachegen's packed default level beside the tcq level), and ``cachegen store stats``'s
``raw_bf16_bytes`` / ``payload_to_raw`` on real KV.

``pytest -rP tests/connector/test_storage.py -k cost`` prints the storage cost table of
docs/connector.md ("Storage cost").
"""

from __future__ import annotations

import json

import pytest
import torch

from cachegen.cli import main
from cachegen.codec.catalog import storage_ladder, tcq_storage_ladder
from cachegen.connector.config import RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.ladder import (
    LADDER_BUDGET_BITS,
    LADDER_HEADROOM_BITS,
    TCQ_LADDER_BUDGET_BITS,
)
from cachegen.connector.save_plan import SavePrefix
from cachegen.errors import InputError
from cachegen.modes import CACHEGEN, CODED, PACKED, TCQ, Form
from cachegen.store import RecordAddress
from cachegen_lab.connector.options import LabRequestOptions
from tests.support import CHUNK, connector_transport, generate_with_params

CHUNKS = 3
BUDGET = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS  # cachegen's save ladder's


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "tiny_llama"])
def test_default_ladder_fits_half_of_raw_bf16(model, request, tmp_path):
    spec = request.getfixturevalue(model)
    t = connector_transport(spec, tmp_path)
    try:
        codec = t.codec("cachegen")
        ladder = t.forms("cachegen")
        default = codec.default_level
        coded = [f.level for f in ladder if f.packing == CODED]
        assert coded[0] == default and len(coded) <= 3 and len(set(ladder)) == len(ladder)
        assert set(coded) <= set(codec.levels)
        bits = {lv: codec.estimated_bits(lv, CHUNK) for lv in coded}
        packed = codec.estimated_bits(default, CHUNK, PACKED)
        assert bits[default] < packed  # the packed form is the larger one
        budget = LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        if bits[default] + packed <= budget:  # the default, coded and packed, fits: both stored
            both = [Form(CACHEGEN, default), Form(CACHEGEN, default, PACKED)]
            assert ladder[:2] == both and len(ladder) == len(coded) + 1
            assert sum(bits.values()) + packed <= budget
        else:
            assert ladder == [Form(CACHEGEN, lv) for lv in coded]
            assert sum(bits.values()) <= budget
        assert all(bits[lv] < bits[default] for lv in coded[1:])  # smaller forms only
        assert t.ladder.adaptive_levels == coded  # adaptive chooses among the coded levels stored
        calibrated = codec.profile.calibrated_levels()
        if calibrated:
            assert set(coded) <= set(calibrated)
        assert t.forms("int8") == [Form("int8")]  # other codecs: their one form, unchanged
        assert t.load_forms(RequestOptions(mode="int8")) == [Form("int8")]
        with pytest.raises(InputError, match="int8 has one level, 0, not 3"):
            t.load_forms(RequestOptions(mode="int8", level=3))
    finally:
        t.close()


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_saving_adaptive_adds_cheaper_levels_after_both_forms(model, request, tmp_path):
    """With ``adaptive`` among the save modes, the ladder is the default's two forms, then the
    cheaper levels the ladder rule picks beside the coded default alone: adaptive's ladder."""
    spec = request.getfixturevalue(model)
    t = connector_transport(spec, tmp_path, save_modes=["adaptive"])
    try:
        codec = t.codec("cachegen")
        default = codec.default_level
        pool = {*codec.profile.calibrated_levels(), default}
        coded = storage_ladder(
            default, {lv: codec.estimated_bits(lv, CHUNK) for lv in pool}, BUDGET
        )
        assert len(coded) > 1  # the rule finds cheaper levels for both shipped models
        packed = codec.estimated_bits(default, CHUNK, PACKED)
        both = codec.estimated_bits(default, CHUNK) + packed
        forms = (
            [Form(CACHEGEN, default), Form(CACHEGEN, default, PACKED)]
            if both <= LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
            else [Form(CACHEGEN, default)]
        )
        assert t.forms("adaptive") == [*forms, *(Form(CACHEGEN, lv) for lv in coded[1:])]
        assert t.ladder.adaptive_levels == coded
    finally:
        t.close()


def test_ladders_of_the_shipped_models(smollm2, gemma3, tiny_llama, tmp_path):
    """The ladders docs/connector.md quotes: cachegen's, and tcq's default ladder."""
    got = {}
    for spec in (smollm2, gemma3, tiny_llama):
        t = connector_transport(spec, tmp_path)
        try:
            got[spec.name] = (
                [f.label for f in t.forms("cachegen")],
                [f.label for f in t.ladder.tcq_ladder],
            )
        finally:
            t.close()
    assert got == {
        "smollm2-135m": (["cachegen-11", "cachegen-11-packed"], ["tcq-22", "cachegen-11-packed"]),
        "gemma3-270m": (["cachegen-9", "cachegen-9-packed"], ["tcq-23", "cachegen-9-packed"]),
        "tiny-llama": (["cachegen-2"], ["tcq-23", "cachegen-2-packed"]),  # nor would preset 2
    }


def test_storage_ladder_rule():
    bits = {1: 1.0, 2: 1.5, 3: 2.0, 4: 3.0, 5: 4.0}
    # the cheapest, then the nearest the midpoint
    assert storage_ladder(4, bits, BUDGET) == [4, 1, 3]
    assert storage_ladder(4, bits, 5.9) == [4, 1, 2]  # level 3 no longer fits
    assert storage_ladder(4, bits, 3.5) == [4]  # not even the cheapest fits
    assert storage_ladder(1, bits, BUDGET) == [1]  # nothing cheaper than the default
    assert storage_ladder(5, {5: 4.0, 1: 1.0}, BUDGET) == [5, 1]


def test_tcq_storage_ladder_rule():
    tcq, tcq_packed = Form(TCQ, 24), Form(TCQ, 24, PACKED)
    cachegen_packed = Form(CACHEGEN, 11, PACKED)
    fast = [cachegen_packed, tcq_packed]  # in order of preference: the faster decode first
    budget = TCQ_LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
    assert budget == pytest.approx(6.35)  # 0.4 of bf16's 16 bits, less the headroom
    bits = {tcq: 2.2, cachegen_packed: 4.1, tcq_packed: 3.4}
    assert tcq_storage_ladder(tcq, fast, bits, budget) == [tcq, cachegen_packed]  # 6.3
    bits[cachegen_packed] = 4.2  # 6.4 with the coded level: over, so tcq's packed form (5.6)
    assert tcq_storage_ladder(tcq, fast, bits, budget) == [tcq, tcq_packed]
    bits[tcq] = 3.0  # 7.2 and 6.4: neither fits, the coded level is stored alone
    assert tcq_storage_ladder(tcq, fast, bits, budget) == [tcq]
    assert tcq_storage_ladder(tcq, [], bits, budget) == [tcq]


@pytest.mark.parametrize("model", ["smollm2", "gemma3", "tiny_llama"])
def test_the_tcq_default_ladder_follows_the_rule(model, request, tmp_path):
    """tcq's default ladder is its default level, coded and written first, then the rule's fast
    form, stored under its own codec's keys; estimates from the model files alone."""
    spec = request.getfixturevalue(model)
    t = connector_transport(spec, tmp_path, mode="tcq")
    try:
        tcq, cachegen = t.codec("tcq"), t.codec("cachegen")
        default = Form(TCQ, tcq.default_level)
        fast = [Form(CACHEGEN, cachegen.default_level, PACKED), Form(TCQ, default.level, PACKED)]
        bits = {
            f: t.codec(f.codec).estimated_bits(f.level, CHUNK, f.packing) for f in [default, *fast]
        }
        budget = TCQ_LADDER_BUDGET_BITS - LADDER_HEADROOM_BITS
        ladder = t.ladder.tcq_ladder
        assert ladder == tcq_storage_ladder(default, fast, bits, budget)
        assert ladder[0] == default and sum(bits[f] for f in ladder) <= budget
        assert t.config.save_modes == ("tcq",) and t.forms("tcq") == [
            f for f in ladder if f.codec == TCQ
        ]
        by_codec: dict[str, list[Form]] = {}
        for form in ladder:
            by_codec.setdefault(form.codec, []).append(form)
        assert t.ladder.stored_forms(["tcq"]) == by_codec
        assert t.ladder.first_forms(["tcq"]) == {"tcq": [default]}  # loadable soonest
        # the loss of every stored form is known where the model ships both calibrations
        losses = t.ladder.form_loss_pct
        assert all((losses[f.label] is not None) == (model != "tiny_llama") for f in ladder)
    finally:
        t.close()


def test_explicit_tcq_levels_are_stored_as_given(smollm2, tmp_path):
    packed = Form(TCQ, 24, PACKED)
    for forms in ([Form(TCQ, 24)], [Form(TCQ, 23), packed], [packed]):
        named = [f.label if f.packing == PACKED else f.level for f in forms]
        t = connector_transport(smollm2, tmp_path, mode="tcq", tcq_levels=named)
        try:
            assert t.forms("tcq") == forms
            assert t.ladder.stored_forms(["tcq"]) == {"tcq": forms}  # nothing borrowed
        finally:
            t.close()
    t = connector_transport(smollm2, tmp_path, tcq_levels=["tcq-99-packed", 24])
    try:
        with pytest.raises(ConnectorError, match=r"tcq_levels \['tcq-99-packed'\] are not levels"):
            t.forms("tcq")
    finally:
        t.close()


def test_a_mixed_tcq_ladder_stores_cachegens_packed_form_under_its_keys(tiny_llama, tmp_path):
    """tiny-llama's tcq ladder holds cachegen's packed default level: a save writes the tcq
    level of every chunk first, then the packed records under cachegen's keys, with cachegen's
    profile in the store. A ``cachegen`` request loads only what its own ladder holds, and
    ``adaptive`` with a bound finds the chunks by the tcq level."""
    from cachegen.codec.coding.bitstream import parse_header

    t = connector_transport(tiny_llama, tmp_path, mode="tcq")
    try:
        tcq_form, fast = t.ladder.tcq_ladder
        assert (tcq_form.codec, fast.codec, fast.packing) == (TCQ, CACHEGEN, PACKED)
        ids = list(range(5, 5 + CHUNKS * CHUNK))
        kv = _random_kv(tiny_llama, ids)
        records = t.save_records(SavePrefix(ids, ["tcq"]), kv)
        assert [(r.address, r.first) for r in records] == [
            *((RecordAddress.of(key, tcq_form), True) for key in t.keys("tcq", ids)),
            *((RecordAddress.of(key, fast), False) for key in t.keys("cachegen", ids)),
        ]
        for record in records[:CHUNKS]:  # the first pass: loadable, not yet saved in full
            t.write(record)
        assert t.stored_chunks(ids, RequestOptions(mode="tcq")) == CHUNKS
        assert t.saved_chunks(ids, ["tcq"]) == 0
        for record in records[CHUNKS:]:
            t.write(record)
        assert t.saved_chunks(ids, ["tcq"]) == CHUNKS
        header = parse_header(t.store.read(RecordAddress.of(t.keys("cachegen", ids)[0], fast)))
        assert (header.form, header.level) == (PACKED, fast.level)
        profile = t.codec("cachegen").profile
        assert all(t.store.get_tables(i) is not None for i in profile.tables_ids.values())

        assert t.forms("cachegen") == [fast.coded]  # cachegen's own ladder: the coded level
        assert t.stored_chunks(ids, RequestOptions(mode="cachegen")) == 0  # no save wrote it
        stored = rf"cachegen stores the forms \['cachegen-2'\], not {fast.label}"
        with pytest.raises(ConnectorError, match=stored):
            t.stored_chunks(ids, RequestOptions().override({"form": fast.label}))

        bound = RequestOptions(mode="adaptive", max_loss_pct=1)
        assert t.ladder.lookup_codec(bound) == TCQ and t.stored_chunks(ids, bound) == CHUNKS
        plan = t.parts.load_plan(0, CHUNKS, CHUNKS * CHUNK, bound)
        sizes = {o.name: o.sizes for o in t.index.stored_options(ids, plan, None)}
        assert sizes.keys() == {"cachegen-2", "cachegen-2-packed", tcq_form.label}
        assert sizes["cachegen-2"] == [None] * CHUNKS  # offered (another engine may store it)
        assert all(sizes[name][0] for name in ("cachegen-2-packed", tcq_form.label))
    finally:
        t.close()


def _random_kv(spec, ids: list[int]):
    from cachegen.kv import KVCache

    ident = spec.identity()
    shape = (ident.num_layers, ident.num_kv_heads, len(ids), ident.head_dim)
    generator = torch.Generator().manual_seed(0)
    return KVCache(
        keys=torch.randn(shape, generator=generator).to(torch.bfloat16),
        values=torch.randn(shape, generator=generator).to(torch.bfloat16),
        token_ids=torch.tensor(ids),
        model=ident,
    )


def test_explicit_cachegen_levels_are_stored_as_given(smollm2, tmp_path):
    """Exactly the configured levels are stored; adaptive chooses among the calibrated ones of
    them (they dominate the paper's presets), or among all when none is calibrated."""
    for levels, adaptive in (
        ([2, 4], [4]),
        ([1, 2, 3, 4, 6, 7, 8, 9, 10], [4, 6, 7, 8, 9, 10]),
        ([1, 2, 3], [1, 2, 3]),
        (["cachegen-4-packed", 4, 10], [4, 10]),  # a packed form is stored, never adaptive's
    ):
        forms = [Form.parse(lv) if isinstance(lv, str) else Form(CACHEGEN, lv) for lv in levels]
        t = connector_transport(smollm2, tmp_path, cachegen_levels=levels)
        try:
            assert t.forms("cachegen") == t.forms("adaptive") == forms
            assert t.ladder.adaptive_levels == adaptive
        finally:
            t.close()


def test_a_level_outside_the_ladder_is_a_clean_miss(smollm2, tmp_path):
    """A request for a level that is not stored gets a ConnectorError from the lookup, which the
    scheduler turns into a recomputation with the reason in the request's report."""
    t = connector_transport(smollm2, tmp_path)
    try:
        assert t.load_forms(RequestOptions(mode="cachegen")) == [Form(CACHEGEN, 11)]
        packed = RequestOptions(mode="cachegen", level=11, form="cachegen-11-packed")
        assert t.load_forms(packed) == [Form(CACHEGEN, 11, PACKED)]  # the packed form is stored
        stored = r"stores the forms \['cachegen-11', 'cachegen-11-packed'\], not cachegen-3"
        with pytest.raises(ConnectorError, match=stored):
            t.stored_chunks(list(range(CHUNKS * CHUNK)), RequestOptions(level=3))
    finally:
        t.close()


# ---- measured on real KV ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_kv():
    """``real_kv(spec)``: (token ids, KV) of CHUNKS chunks of held-out documentation text."""
    from cachegen import workload
    from cachegen.extract import extract_kv, load_model

    cache = {}

    def make(spec):
        if spec.name not in cache:
            _, tokenizer, _ = load_model(spec)
            ids = tokenizer(workload.text("eval")[: 12 * CHUNKS * CHUNK])["input_ids"]
            ids = ids[: CHUNKS * CHUNK]
            assert len(ids) == CHUNKS * CHUNK
            cache[spec.name] = (ids, extract_kv(spec, token_ids=ids))
        return cache[spec.name]

    return make


def test_the_default_level_is_stored_coded_and_packed(smollm2, real_kv, tmp_path):
    """With default settings each chunk's default level is stored twice, coded and packed; both
    decode to the same KV, and a request naming the packed form finds the chunks."""
    import torch

    from cachegen.codec import decode
    from cachegen.codec.coding.bitstream import parse_header

    ids, kv = real_kv(smollm2)
    t = connector_transport(smollm2, tmp_path)
    try:
        default = t.codec("cachegen").default_level
        t.save(ids, kv, ["cachegen"])
        key = t.keys("cachegen", ids)[0]
        coded, packed = (
            t.store.read(RecordAddress.of(key, Form(CACHEGEN, default, packing)))
            for packing in (CODED, PACKED)
        )
        assert (parse_header(coded).form, parse_header(packed).form) == ("coded", "packed")
        assert len(coded) < len(packed)
        a, b = decode(coded), decode(packed)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        tagged = RequestOptions().override({"form": f"cachegen-{default}-packed"})
        assert t.stored_chunks(ids, tagged) == CHUNKS
    finally:
        t.close()


def test_adaptive_chooses_among_the_forms_of_a_mixed_tcq_ladder(smollm2, real_kv, tmp_path):
    """``adaptive`` with ``max_loss_pct`` over tcq's default ladder when it holds cachegen's
    packed default (SmolLM2's): on an unshaped link the packed form, which decodes several
    times faster, on a slow one the tcq level, which is smaller; each chosen with what earlier
    loads of both forms measured."""
    from cachegen.codec import decode

    ids, kv = real_kv(smollm2)
    t = connector_transport(smollm2, tmp_path, mode="tcq", prefill_tokens_per_s=10.0)
    try:
        tcq_form, fast = t.ladder.tcq_ladder
        assert (tcq_form.label, fast.label) == ("tcq-22", "cachegen-11-packed")
        t.save(ids, kv, ["tcq"])
        for form in (tcq_form, fast):  # each decoder's kernels compiled before it is timed
            decode(t.store.read(RecordAddress.of(t.keys(form.codec, ids)[0], form)))
        for fixed in (RequestOptions(mode="tcq"), RequestOptions().override({"form": fast.label})):
            assert t.load(ids, 0, CHUNKS, fixed, lambda kv: None).chunks_loaded == CHUNKS

        def adaptive(**link) -> list[str]:
            bound = LabRequestOptions(mode="adaptive", max_loss_pct=2, **link)  # tcq-22's target
            result = t.load(ids, 0, CHUNKS, bound, lambda kv: None)
            assert result.error is None and result.chunks_loaded == CHUNKS
            assert {tcq_form.label, fast.label} <= {
                name
                for name, loss in result.stats["form_loss_pct"].items()
                if loss is not None and loss <= 2
            }
            return result.stats["forms"]

        assert adaptive() == [fast.label] * CHUNKS
        assert adaptive(bandwidth_mbps=20) == [tcq_form.label] * CHUNKS
    finally:
        t.close()


def store_stats(capsys, url: str) -> dict:
    capsys.readouterr()
    assert main(["store", "stats", "--store", url, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def raw_bf16(spec) -> int:
    ident = spec.identity()
    return 2 * 2 * ident.num_layers * ident.num_kv_heads * ident.head_dim * CHUNKS * CHUNK


COST_CONFIGS = {
    "tcq's save ladder": ({"mode": "tcq"}, ["tcq"]),  # the default of a model with both files
    "tcq_levels = [default]": ("tcq default", ["tcq"]),
    "cachegen's save ladder": ({}, ["cachegen"]),
    "cachegen_levels = [default]": ("default", ["cachegen"]),
    "default + adaptive levels": ("coded ladder", ["cachegen"]),
    "save_modes adaptive": ({"save_modes": ["adaptive"]}, ["adaptive"]),
    "every level": ("all", ["cachegen"]),
    "save_modes raw": ({}, ["raw"]),
    "save_modes int8": ({}, ["int8"]),
}


def cost_options(spec, config: str, tmp_path) -> dict:
    """The connector options of a named storage configuration: tcq's default level alone, or
    these cachegen levels: the default level alone, every level, or adaptive's coded ladder
    (the default, then the cheaper calibrated levels that :func:`storage_ladder` picks within
    the budget beside the coded default)."""
    t = connector_transport(spec, tmp_path)
    try:
        if config == "tcq default":
            return {"mode": "tcq", "tcq_levels": [t.codec("tcq").default_level]}
        codec = t.codec("cachegen")
        default = codec.default_level
        if config == "default":
            return {"cachegen_levels": [default]}
        if config == "all":
            return {"cachegen_levels": list(codec.levels)}
        pool = {*codec.profile.calibrated_levels(), default}
        ladder = storage_ladder(
            default, {lv: codec.estimated_bits(lv, CHUNK) for lv in pool}, BUDGET
        )
        return {"cachegen_levels": ladder}
    finally:
        t.close()


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
@pytest.mark.parametrize("name", list(COST_CONFIGS))
def test_storage_cost(model, name, request, real_kv, tmp_path, capsys):
    spec = request.getfixturevalue(model)
    ids, kv = real_kv(spec)
    extra, modes = COST_CONFIGS[name]
    if isinstance(extra, str):
        extra = cost_options(spec, extra, tmp_path)
    t = connector_transport(spec, tmp_path, **extra)
    try:
        written = t.save(ids, kv, modes)
        stored = t.ladder.stored_forms(modes).values()
        forms = [form.label for codec_forms in stored for form in codec_forms]
    finally:
        t.close()
    stats = store_stats(capsys, (tmp_path / "store").as_uri())
    assert stats["payload_bytes"] == written
    assert stats["raw_bf16_bytes"] == raw_bf16(spec)  # one copy per chunk, parts add up
    assert stats["payload_to_raw"] == pytest.approx(written / raw_bf16(spec), abs=1e-4)
    ratio = written / stats["raw_bf16_bytes"]
    with capsys.disabled():
        print(f"\n{spec.name:14} {name:28} {', '.join(forms)}: payload/raw bf16 = {ratio:.3f}")
    if name == "tcq's save ladder":
        assert ratio <= TCQ_LADDER_BUDGET_BITS / 16
    if name == "cachegen's save ladder":
        assert ratio <= LADDER_BUDGET_BITS / 16
    if name == "save_modes raw":
        assert 1.0 <= ratio < 1.01  # the raw payload is the bf16 KV plus headers and token ids


def test_stats_text_output_and_non_bitstream_records(tmp_path, capsys):
    from cachegen.store import open_store

    url = (tmp_path / "store").as_uri()
    # `store put-blob` refuses what is not a bitstream: such a record is written directly
    with open_store(url) as store:
        store.write(RecordAddress.of("ns/abc", "int8"), b"not a bitstream")
    stats = store_stats(capsys, url)
    assert stats["raw_bf16_bytes"] == 0 and stats["payload_to_raw"] is None
    assert stats["raw_bf16_skipped_keys"] == 1
    assert main(["store", "stats", "--store", url]) == 0
    text = capsys.readouterr().out
    assert "raw_bf16_bytes: 0" in text and "payload_to_raw: None" in text


def test_serving_a_document_with_default_settings(smollm2, tmp_path, capsys):
    """vLLM with the connector's defaults (for SmolLM2: mode tcq, its save ladder): after one
    request over a document the store holds at most 0.4 of its raw bf16 KV; a second request
    over the same document, naming no mode, loads all of it at the tcq default level, and
    ``adaptive`` with a quality bound loads it in the ladder's forms (which of them rests on
    one earlier load's measurements; test_adaptive_chooses_among_the_forms_of_a_mixed_tcq_
    ladder checks the choice)."""
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from cachegen import workload
    from cachegen_lab.bench.engine import ConnectorEngine

    url = (tmp_path / "served").as_uri()
    with ConnectorEngine(
        smollm2,
        store=url,
        save_modes=None,  # the connector's defaults for what it stores
        max_model_len=2048,
        prefill_tokens_per_s=10.0,  # adaptive chooses among stored forms, never recomputation
    ) as engine:
        config = engine.config
        assert (config.defaults.mode, config.save_modes, config.tcq_levels) == (
            "tcq",
            ("tcq",),
            None,
        )
        default = engine.transport.codec("tcq").default_level
        document = engine.tokenize(workload.text("eval")[20_000:40_000])[:1536]
        question = engine.tokenize("\n\nQuestion: what is this about? Answer:", bos=False)
        engine.store_prefix(document + question)
        _, again = generate_with_params(engine, document + question, {})
        assert again["mode"] == "tcq" and again["loaded_tokens"] == 1536
        assert again["forms"] == [f"tcq-{default}"] * 6
        forms = engine.transport.ladder.tcq_ladder
        labels = [f.label for f in forms]
        assert labels == [f"tcq-{default}", "cachegen-11-packed"]  # the rule's fast form
        ladder, codecs = set(labels), {f.codec for f in forms}
        _, bounded = generate_with_params(
            engine, document + question, {"mode": "adaptive", "max_loss_pct": 1}
        )
        assert bounded["loaded_tokens"] == 1536 and set(bounded["forms"]) <= ladder
    stats = store_stats(capsys, url)
    # each chunk under the keys of each codec of the ladder
    assert stats["chunks"] == 6 * len(codecs) and stats["payload_to_raw"] <= 0.4
    print(f"served document: payload/raw bf16 = {stats['payload_to_raw']}")


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
def test_raw_chunks_load_exactly_into_the_engines_dtype(tiny_llama, tmp_path, engine_dtype):
    """A float32 engine (CPUs without bf16 instructions) stores float32 raw chunks and loads
    them back bit for bit; a bf16 engine reading the same chunks gets them rounded once."""
    from cachegen.kv import KVCache

    ident = tiny_llama.identity()
    shape = (ident.num_layers, ident.num_kv_heads, CHUNKS * CHUNK, ident.head_dim)
    torch.manual_seed(0)
    kv = KVCache(
        keys=torch.randn(shape),
        values=torch.randn(shape),
        token_ids=torch.arange(7, 7 + CHUNKS * CHUNK),
        model=ident,
    )
    ids = kv.token_ids.tolist()
    t = connector_transport(tiny_llama, tmp_path)
    try:
        t.save(ids, kv, ["raw"])
        got: list[KVCache] = []
        options = RequestOptions(mode="raw")
        result = t.load(ids, 0, CHUNKS, options, got.append, out_dtype=engine_dtype)
        assert result.error is None and result.chunks_loaded == CHUNKS
        loaded = KVCache.concat(got)
        assert loaded.dtype == engine_dtype
        assert torch.equal(loaded.keys, kv.keys.to(engine_dtype))
        assert torch.equal(loaded.values, kv.values.to(engine_dtype))
    finally:
        t.close()
