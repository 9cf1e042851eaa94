"""Disaggregated prefill: a producer engine and a consumer engine, each in its own process,
share one Redis store; the consumer answers from the prefix the producer computed.

The two engines run one after the other (a test never holds two vLLM engines at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

ROLE_SCRIPT = Path(__file__).with_name("disagg_role.py")
REPO = Path(__file__).resolve().parents[2]


def _role(role: str, model_dir: Path, store: str, ids: list[int]) -> dict:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    out = subprocess.run(
        [sys.executable, str(ROLE_SCRIPT), role, str(model_dir), store, json.dumps(ids)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_disaggregated_prefill_through_redis(tiny_llama, redis_url, doc_text):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama.path)
    ids = tokenizer(doc_text[35_000:45_000])["input_ids"][:700]
    producer = _role("producer", tiny_llama.path, redis_url, ids)
    consumer = _role("consumer", tiny_llama.path, redis_url, ids)
    assert producer["connector"].get("save_chunks") == 2
    assert consumer["connector"]["loaded_tokens"] == 512 and consumer["cached_tokens"] == 512
    assert consumer["token_ids"] == producer["token_ids"]
