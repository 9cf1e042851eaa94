"""The tiny models and SmolLM2 load in vLLM's CPU build and generate, in bf16, the models' own
dtype, whatever the CPU (one process of their own, one engine after another)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen.extract import load_model

SCRIPT = Path(__file__).with_name("vllm_generate.py")
TINY_PROMPT = "The KV cache of a long context"


def _smollm2_prompt(smollm2) -> str:
    """The answer's first words are given: the first token alone is a near-tie ("The" and "L"
    one bf16 step apart in vLLM on CPUs with AMX, which then answers "L'Étoile, ..."), while
    " Paris" after them leads its runner-up by several nats."""
    _, tokenizer, _ = load_model(smollm2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return prompt + "The capital of France is"


@pytest.fixture(scope="module")
def answers(tiny_llama, tiny_opt, smollm2) -> dict[str, dict]:
    jobs = {
        "tiny_llama": {"model": str(tiny_llama.path), "prompt": TINY_PROMPT, "max_tokens": 8},
        "tiny_opt": {"model": str(tiny_opt.path), "prompt": TINY_PROMPT, "max_tokens": 8},
        "smollm2": {
            "model": str(smollm2.path),
            "prompt": _smollm2_prompt(smollm2),
            "max_tokens": 4,
        },
    }
    out = subprocess.run(
        [sys.executable, str(SCRIPT)],
        input=json.dumps(list(jobs.values())),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(jobs, json.loads(out.stdout.strip().splitlines()[-1]), strict=True))


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_opt"])
def test_tiny_model_generates_in_vllm(answers, model):
    assert len(answers[model]["token_ids"]) == 8


def test_smollm2_answers_in_vllm(answers):
    assert answers["smollm2"]["text"].startswith(" Paris")
