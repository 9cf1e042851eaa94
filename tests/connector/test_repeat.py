"""Hits from the first repeat: a prompt's chunks become loadable as soon as their first level is
stored (a save writes the first level of every chunk, in prefix order, before the other
levels), and a repeat sent the moment the first answer ends waits for them instead of missing.
"""

from __future__ import annotations

import threading

import pytest
import torch

from cachegen.connector.config import RequestOptions
from cachegen.connector.metadata import SaveTask
from cachegen.connector.save_plan import SavePrefix
from cachegen.connector.worker import _SaveJob, _Saver
from cachegen.extract import extract_kv
from cachegen.modes import CACHEGEN, Form
from cachegen_lab.connector.options import LabRequestOptions
from tests.support import CHUNK, connector_engine, connector_transport

CHUNKS = 3


@pytest.fixture(scope="module")
def tiny_kv(tiny_llama):
    ids = list(range(3, 3 + CHUNKS * CHUNK))
    return ids, extract_kv(tiny_llama, token_ids=torch.tensor(ids))


ADAPTIVE = RequestOptions(mode="adaptive", slo_ms=60_000.0)


def test_first_levels_are_what_a_request_without_a_level_needs(smollm2, tmp_path):
    raw = [Form("raw")]
    for extra, firsts in (
        ({}, [Form(CACHEGEN, 11)]),
        ({"cachegen_levels": [2, 4]}, [Form(CACHEGEN, 4)]),
        ({}, raw),
    ):
        t = connector_transport(smollm2, tmp_path, **extra)
        try:
            mode = "raw" if firsts == raw else "cachegen"
            assert t.ladder.first_of(mode) == firsts
            if mode == "cachegen":
                first_adaptive = [Form(CACHEGEN, t.ladder.adaptive_levels[0])]
                assert t.load_forms(ADAPTIVE) == first_adaptive == firsts
        finally:
            t.close()


def test_a_save_writes_the_first_level_of_every_chunk_before_the_others(
    tiny_llama, tiny_kv, tmp_path
):
    ids, kv = tiny_kv
    t = connector_transport(tiny_llama, tmp_path, cachegen_levels=[2, 1])
    try:
        ladder = t.forms("cachegen")
        assert len(ladder) >= 2  # else there is no second pass to order
        (int8,) = t.forms("int8")
        keys = {m: t.keys(m, ids) for m in ("cachegen", "int8")}
        records = t.save_records(SavePrefix(ids, ["cachegen", "int8"]), kv)
        got = [
            (
                r.address.form.codec,
                keys[r.address.form.codec].index(r.address.key),
                r.address.form,
                r.first,
            )
            for r in records
        ]
        first_pass = [
            (m, c, form, True)
            for c in range(CHUNKS)
            for m, form in (("cachegen", ladder[0]), ("int8", int8))
        ]
        rest = [("cachegen", c, form, False) for c in range(CHUNKS) for form in ladder[1:]]
        assert got == first_pass + rest

        # Against the real store: after the first pass every chunk is loadable in every mode
        # a request without a level uses, although no chunk is stored at every level yet.
        for record in records[: len(first_pass)]:
            assert t.write(record) > 0
        for options in (RequestOptions(mode="cachegen"), RequestOptions(mode="int8"), ADAPTIVE):
            assert t.stored_chunks(ids, options) == CHUNKS
        assert t.saved_chunks(ids, ["cachegen"]) == 0
        assert t.save(ids, kv, ["cachegen", "int8"]) > 0  # writes only the other levels
        assert t.saved_chunks(ids, ["cachegen", "int8"]) == CHUNKS
        assert t.save(ids, kv, ["cachegen", "int8"]) == 0  # everything stored: skipped
    finally:
        t.close()


def test_adaptive_loads_chunks_stored_at_their_first_level_only(tiny_llama, tiny_kv, tmp_path):
    ids, kv = tiny_kv
    t = connector_transport(
        tiny_llama, tmp_path, save_modes=["adaptive"]
    )  # adaptive's ladder is stored
    try:
        records = t.save_records(SavePrefix(ids, ["adaptive"]), kv)
        for record in records:
            if record.first:
                t.write(record)
        first = t.ladder.adaptive_levels[0]
        coarse = [lv for lv in t.ladder.adaptive_levels if lv != first]
        assert coarse  # the tiny model's ladder has a cheaper level
        # Chunk 0 also at the cheaper levels, the others only at the first: a save half done.
        for record in records:
            if not record.first and record.address.key == t.keys("cachegen", ids)[0]:
                t.write(record)
        for bandwidth in (None, 50.0):  # without a throughput prior, and with one
            got: list[int] = []
            options = LabRequestOptions(mode="adaptive", slo_ms=60_000.0, bandwidth_mbps=bandwidth)
            result = t.load(ids, 0, CHUNKS, options, lambda kv: got.append(kv.start))
            assert result.error is None and result.chunks_loaded == CHUNKS
            assert got == [c * CHUNK for c in range(CHUNKS)]
            forms = result.stats["forms"]
            assert forms[0] in [Form(CACHEGEN, lv).label for lv in t.ladder.adaptive_levels]
            # the only level they are stored at
            assert forms[1:] == [Form(CACHEGEN, first).label] * (CHUNKS - 1)
    finally:
        t.close()


def test_the_saver_writes_every_queued_first_pass_before_any_other_level(
    tiny_llama, tiny_kv, tmp_path
):
    """Two prompts saved back to back (the second under another key scope): both first passes
    are stored before the first prompt's other levels; each first pass is reported once."""
    ids, kv = tiny_kv
    t = connector_transport(tiny_llama, tmp_path)
    submitted = threading.Event()
    written: list[tuple[str | None, bool]] = []
    reported: list[str] = []
    salts = {}

    def write(record):
        submitted.wait(timeout=60)  # the first record waits until both jobs are queued
        written.append((salts[record.address.key], record.first))
        return t.write(record)

    def plan(task, kv):
        records = t.save_records(SavePrefix(task.token_ids, task.modes, salt=task.salt), kv)
        salts.update({r.address.key: task.salt for r in records})
        return records

    saver = _Saver(plan, write, lambda timeout: None, lambda job: reported.append(job.task.salt), 4)
    try:
        for salt in ("a", "b"):
            saver.submit(_SaveJob(SaveTask(salt, ids, [], ("cachegen",), salt=salt), kv))
        submitted.set()
        saver.close(timeout=120)
        ladder = t.forms("cachegen")
        firsts = [(s, True) for s in ("a", "b") for _ in range(CHUNKS)]
        rest = [(s, False) for s in ("a", "b") for _ in range(CHUNKS * (len(ladder) - 1))]
        assert written == firsts + rest
        assert reported == ["a", "b"]
    finally:
        t.close()


# ---- through vLLM -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2, tmp_path_factory):
    store = tmp_path_factory.mktemp("repeat-store").as_uri()
    # The default save ladder (three levels); a generous save_wait_ms keeps the test free of
    # wall-clock limits on a busy machine.
    with connector_engine(
        smollm2, store, save_modes=("cachegen",), connector_extra={"save_wait_ms": 600_000}
    ) as eng:
        yield eng


def test_an_immediate_repeat_loads_every_whole_chunk_of_the_document(engine, text_ids):
    document = text_ids(engine, 6 * CHUNK + 100)
    ask = [
        engine.tokenize(f"\n\nQuestion {n}: what does the text above explain? Answer:", bos=False)
        for n in (1, 2, 3)
    ]
    first = engine.run(document + ask[0], mode="cachegen", save=True, max_tokens=4)
    assert first.connector.get("loaded_tokens", 0) == 0  # a new document: nothing stored
    # No sleep: sent the moment the first answer's last token arrived.
    second = engine.run(document + ask[1], mode="cachegen", save=True, max_tokens=4)
    assert second.connector["loaded_tokens"] == 6 * CHUNK, second.connector
    assert second.connector["chunks"] == 6 and "load_error" not in second.connector
    assert "save_wait_timed_out" not in second.connector
    third = engine.run(document + ask[2], mode="adaptive", slo_ms=60_000.0, max_tokens=4)
    assert third.connector["loaded_tokens"] == 6 * CHUNK, third.connector
    adaptive = {Form(CACHEGEN, lv).label for lv in engine.transport.ladder.adaptive_levels}
    assert set(third.connector["forms"]) <= adaptive
