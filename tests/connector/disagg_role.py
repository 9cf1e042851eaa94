"""One side of disaggregated prefill, run in its own process by test_disagg.py.

    python tests/connector/disagg_role.py producer|consumer MODEL_DIR REDIS_URL TOKEN_IDS_JSON DTYPE

The producer (kv_role=kv_producer) prefills the prompt and waits until its KV chunks are in
the shared Redis store; the consumer (kv_role=kv_consumer) answers the same prompt from
those chunks. The engine runs in DTYPE (vLLM's ``dtype``). Each prints one JSON line: the
answer's token ids and the connector report.
"""

import json
import sys

if __name__ == "__main__":
    from cachegen_lab.bench.engine import ConnectorEngine

    role, model_dir, store, ids_json, dtype = sys.argv[1:6]
    ids = json.loads(ids_json)
    kv_role = {"producer": "kv_producer", "consumer": "kv_consumer"}[role]
    with ConnectorEngine(
        model_dir, store=store, kv_role=kv_role, max_model_len=2048, dtype=dtype
    ) as engine:
        if role == "producer":
            result = engine.run(ids, mode="recompute", save=True)
            engine.wait_stored(ids, timeout_s=120)
        else:
            result = engine.run(ids, mode="raw")
    print(
        json.dumps(
            {
                "token_ids": result.token_ids,
                "cached_tokens": result.cached_tokens,
                "connector": result.connector,
            }
        )
    )
