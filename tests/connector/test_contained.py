"""No exception leaves a connector hook vLLM calls (tiny-llama, local directory store): a fault
inside one is logged, counted in ``hook_errors`` and becomes a recompute or a skipped save, and
the request is answered as if the connector had nothing. Faults are injected by replacing one
step of the connector's scheduler side with one that raises."""

from __future__ import annotations

import pytest

from cachegen.connector.scheduler import SchedulerSide
from tests.support import connector_engine


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    store = tmp_path_factory.mktemp("contained-store").as_uri()
    with connector_engine(tiny_llama, store) as eng:
        yield eng


def _raises(*args, **kwargs):
    raise RuntimeError("an injected fault")


@pytest.mark.parametrize(
    ("step", "expect", "loaded"),
    [
        ("_matched", {}, 0),  # get_num_new_matched_tokens: a miss
        ("_after_alloc", {"fallback": "internal_error"}, 0),  # a load that fails at once
        ("_plan_save", {"save_skipped": "internal_error"}, 512),  # the save only
    ],
)
def test_a_fault_inside_a_hook_is_a_recompute_and_the_engine_serves_on(
    engine, text_ids, monkeypatch, step, expect, loaded
):
    ids = text_ids(engine, 600, offset=len(step) * 1_000)
    text = engine.run(ids)
    engine.store_prefix(ids)
    monkeypatch.setattr(SchedulerSide, step, _raises)
    faulted = engine.run(ids, mode="raw")
    assert faulted.token_ids == text.token_ids
    assert faulted.connector.get("loaded_tokens", 0) == loaded
    assert expect.items() <= faulted.connector.items()
    monkeypatch.undo()
    hit = engine.run(ids, mode="raw")  # the engine serves on, and the store still hits
    assert hit.connector["loaded_tokens"] == 512 and hit.token_ids == text.token_ids


def test_a_contained_hook_answers_its_fallback_and_counts_the_fault():
    from cachegen.connector.connector import contained
    from cachegen.connector.stats import StatsRecorder

    class Side:
        stats = StatsRecorder()

    class Hooks:
        _worker = None
        _scheduler = Side()

        @contained((0, False))
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            raise OSError(116, "Stale file handle")  # an NFS store's ESTALE

        @contained(lambda finished: set(finished))
        def get_transfer_results(self, finished):
            raise RuntimeError("an injected fault")

    hooks = Hooks()
    assert hooks.get_num_new_matched_tokens(None, 0) == (0, False)
    assert hooks.get_transfer_results({"a"}) == {"a"}
    counted = Side.stats.take().data["hook_errors"]
    assert counted == {"get_num_new_matched_tokens": 1, "get_transfer_results": 1}
