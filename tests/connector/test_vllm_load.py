"""The tiny models and SmolLM2 load in vLLM's CPU build and generate (each in its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachegen.extract import load_model

SCRIPT = Path(__file__).with_name("vllm_generate.py")


def vllm_generate(model_dir: Path, prompt: str, max_tokens: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(model_dir), prompt, str(max_tokens)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_opt"])
def test_tiny_model_generates_in_vllm(request, fixture):
    spec = request.getfixturevalue(fixture)
    result = vllm_generate(spec.path, "The KV cache of a long context", 8)
    assert len(result["token_ids"]) == 8


def test_smollm2_answers_in_vllm(smollm2):
    """The answer's first words are given: the first token alone is a near-tie ("The" and "L"
    one bf16 step apart in vLLM on CPUs with AMX, which then answers "L'Étoile, ..."), while
    " Paris" after them leads its runner-up by several nats."""
    _, tokenizer, _ = load_model(smollm2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    result = vllm_generate(smollm2.path, prompt + "The capital of France is", 4)
    assert result["text"].startswith(" Paris")
