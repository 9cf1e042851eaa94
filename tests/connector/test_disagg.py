"""Disaggregated prefill: a producer engine and a consumer engine, each in its own process,
share one Redis store; the consumer answers from the prefix the producer computed, and a
consumer in the other dtype (bf16 or float32) loads the same chunks.

The engines run one after the other (a test never holds two vLLM engines at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.support import ENGINE_DTYPE, REPO

ROLE_SCRIPT = Path(__file__).with_name("disagg_role.py")
OTHER_DTYPE = {"float32": "bfloat16"}.get(ENGINE_DTYPE, "float32")


def _role(role: str, model_dir: Path, store: str, ids: list[int], dtype: str) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, str(ROLE_SCRIPT), role, str(model_dir), store, json.dumps(ids), dtype],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def produced(tiny_llama, redis_server, doc_text) -> tuple[list[int], dict]:
    """A prompt a producer engine prefilled and saved into Redis, and its answer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    ids = tokenizer(doc_text[35_000:45_000])["input_ids"][:700]
    producer = _role("producer", tiny_llama.path, redis_server.fresh_url(), ids, ENGINE_DTYPE)
    assert producer["connector"].get("save_chunks") == 2
    return ids, producer


def test_disaggregated_prefill_through_redis(tiny_llama, redis_server, produced):
    ids, producer = produced
    consumer = _role("consumer", tiny_llama.path, redis_server.url, ids, ENGINE_DTYPE)
    assert consumer["connector"]["loaded_tokens"] == 512 and consumer["cached_tokens"] == 512
    assert consumer["token_ids"] == producer["token_ids"]


def test_a_consumer_in_the_other_dtype_loads_the_chunks(tiny_llama, redis_server, produced):
    """Raw chunks are in the producer's dtype; an engine in the other dtype loads them too (its
    answer is not compared: the two dtypes round the suffix's arithmetic differently)."""
    ids, producer = produced
    other = _role("consumer", tiny_llama.path, redis_server.url, ids, OTHER_DTYPE)
    assert other["connector"]["loaded_tokens"] == 512 and other["cached_tokens"] == 512
    assert "load_error" not in other["connector"] and "error" not in other["connector"]
    assert len(other["token_ids"]) == len(producer["token_ids"])
