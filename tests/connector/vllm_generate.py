"""Load a model in vLLM's CPU build and greedily answer one prompt; prints JSON.

Run in a subprocess by tests so every engine gets a fresh process.
Usage: python tests/connector/vllm_generate.py MODEL_DIR PROMPT MAX_TOKENS
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model_dir, prompt, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    llm = LLM(model=model_dir, gpu_memory_utilization=0.3, max_model_len=2048, enforce_eager=True)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )[0]
    print(json.dumps({"text": out.outputs[0].text, "token_ids": list(out.outputs[0].token_ids)}))
