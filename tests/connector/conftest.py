"""Fixtures for the connector tests: prompts of real text.

Engines are module-scoped fixtures in the test modules and are closed at the end of their
module, so a test run never holds two vLLM engines at once (each costs seconds to start and
a GiB of KV cache).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


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
