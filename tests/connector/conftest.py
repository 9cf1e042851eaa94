"""Fixtures for the connector tests: prompts of real text.

Engines are module-scoped fixtures in the test modules and are closed at the end of their
module, so a test run never holds two vLLM engines at once (each costs seconds to start and
a GiB of KV cache). They run in ``tests.support.ENGINE_DTYPE``: bf16 where the CPU has bf16
instructions, float32 where bf16 would be emulated (several times slower).

vLLM is imported here, not skipped when missing: these are the product's integration tests, and
a vLLM that fails to import must fail the run.
"""

from __future__ import annotations

import pytest
import vllm  # noqa: F401  (fail the connector suite, never skip it, without vLLM)


@pytest.fixture(scope="session")
def doc_text() -> str:
    """Real English text that ships with CPython (the Python documentation topics), minus
    the topics the codec calibrates on and those kept for choosing levels."""
    from cachegen import workload

    return workload.text("eval")


@pytest.fixture(scope="session")
def text_ids(doc_text):
    """``text_ids(engine, tokens, offset=0)``: token ids of documentation text."""

    def make(engine, tokens: int, offset: int = 0) -> list[int]:
        ids = engine.tokenize(doc_text[offset : offset + 12 * tokens])
        assert len(ids) >= tokens
        return ids[:tokens]

    return make


# Two steps of bf16 logits at the magnitudes the real models produce (16 to 32: steps of 0.125).
NEAR_TIE_NATS = 0.25


@pytest.fixture(scope="session")
def assert_answers_alike():
    """``assert_answers_alike(hit, text)``: a request that loaded its prefix answers as the
    recomputation did (``text``, run with ``margins=True``) token for token, up to a near-tie.

    A loaded prefix has the suffix computed in a batch of another shape than a whole prefill
    does, and vLLM's CPU kernels are not batch-invariant everywhere (with AMX its attention
    and oneDNN's GEMMs tile by batch shape), so the logits may differ by a rounding step and a
    greedy near-tie may go the other way; from there on the answers may part. Anything else,
    a wrong or misplaced block above all, shows as a confident token that differs."""

    def check(hit, text) -> None:
        assert text.margins is not None, "run the recomputation with margins=True"
        for i, (got, want) in enumerate(zip(hit.token_ids, text.token_ids, strict=True)):
            if got != want:
                near = min(text.margins[i], hit.margins[i] if hit.margins else float("inf"))
                assert near <= NEAR_TIE_NATS, (
                    f"output token {i}: {got} where the recomputation gave {want}; the closer "
                    f"run's top token led its runner-up by {near:.3f} nats (not a near-tie)"
                )
                return

    return check


@pytest.fixture
def redis_up(redis_server):
    """The shared redis-server, running and answering before and after a test that stops or
    pauses it."""
    if redis_server.proc is None:
        redis_server.start()
    yield redis_server
    redis_server.resume()
    if redis_server.proc is None:
        redis_server.start()
