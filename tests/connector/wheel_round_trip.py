"""Run by tests/connector/test_server_wheel.py inside a virtual environment that holds the
server's wheel and the lock's packages, nothing of the lab: a connector round trip through
vLLM (store a prompt's chunks, then load them). Prints one JSON line: the modules of
cachegen that came from the lab (none expected), where cachegen was imported from, and the
second request's report.

``python wheel_round_trip.py MODEL_DIR STORE_URL``
"""

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    import cachegen

    model_dir, store = sys.argv[1], sys.argv[2]
    transfer = KVTransferConfig(
        kv_connector="CacheGenConnector",
        kv_connector_module_path="cachegen.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"store": store, "save_async": False, "client_report": "full"},
        kv_load_failure_policy="recompute",
    )
    llm = LLM(
        model=model_dir,
        kv_transfer_config=transfer,
        enable_prefix_caching=False,
        max_model_len=1024,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        dtype="float32",
    )
    prompt = {"prompt_token_ids": [3 + (i * 7) % 250 for i in range(600)]}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    lab = sorted(m for m in sys.modules if m.startswith("cachegen_lab"))
    print(
        json.dumps(
            {
                "lab_modules": lab,
                "cachegen_file": cachegen.__file__,
                "first": first.kv_transfer_params["cachegen"],
                "second": second.kv_transfer_params["cachegen"],
            }
        )
    )
