"""Load models in vLLM's CPU build, one engine after another, and greedily answer a prompt with
each; prints one JSON line, a list of answers.

Run in a subprocess by tests, so that these engines run in the model's own dtype (bf16) with
nothing of cachegen imported: ``python tests/connector/vllm_generate.py < jobs.json`` where
jobs.json is ``[{"model": DIR, "prompt": TEXT, "max_tokens": N}, ...]``.
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    answers = []
    for job in json.load(sys.stdin):
        llm = LLM(
            model=job["model"], gpu_memory_utilization=0.3, max_model_len=2048, enforce_eager=True
        )
        params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
        out = llm.generate([job["prompt"]], params, use_tqdm=False)[0].outputs[0]
        answers.append({"text": out.text, "token_ids": list(out.token_ids)})
        llm.llm_engine.engine_core.shutdown()
        del llm
    print(json.dumps(answers))
