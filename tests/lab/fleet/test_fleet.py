"""``cachegen fleet-bench`` end to end: two tiny-llama vLLM OpenAI-compatible servers in the
``raw`` configuration (the connector over one shared directory store, vLLM's prefix cache on),
three users x two rounds of multi-round QA, round robin. One configuration only, to keep the
suite short: the others differ in the servers' options, not in the command's path. A user's
second round runs on the other server than its first, so the chunks of its history that the
first server stored can only come from the shared store: vLLM's prefix cache cannot give that
reuse."""

from __future__ import annotations

import json

from cachegen.cli import main
from cachegen.lab.fleet import summary

USERS, ROUNDS = 3, 2
ARGS = [
    "fleet-bench",
    "--model", "tiny-llama",
    "--configs", "raw",
    "--servers", "2",
    "--router", "round-robin",
    "--users", str(USERS),
    "--rounds", str(ROUNDS),
    "--system-tokens", "300",  # more than one 256-token chunk (cachegen.constants.CHUNK_TOKENS)
    "--question-tokens", "200",  # so a user's first chunk past the system prompt is its own
    "--max-tokens", "4",
    "--ignore-eos",
]  # fmt: skip


def test_two_servers_share_one_store_and_every_request_is_recorded(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main([*ARGS, "--json", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    assert "fleet-bench: raw: 0 errors" in capsys.readouterr().err

    doc = json.loads(out.read_text())
    summary.validate(doc)
    assert (doc["schema"], doc["version"]) == ("cachegen-fleet-bench", 1)
    assert [c["config"] for c in doc["configs"]] == ["raw"]
    for config in doc["configs"]:
        records = config["records"]
        assert [r["index"] for r in records] == list(range(USERS * ROUNDS))
        assert [r["error"] for r in records] == [None] * len(records)
        assert [r["server"] for r in records] == [0, 1] * (len(records) // 2)
        assert config["summary"]["requests_per_server"] == [3, 3]
        assert config["summary"]["errors"] == 0
        for r in records:
            assert r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["end_s"] - r["send_s"]
            assert r["output_tokens"] == 4 and r["prompt_tokens"] > 256
            assert r["answer"]

    (raw,) = doc["configs"]
    reports = [r["report"] for r in raw["records"]]
    assert all(rep["schema"] == "cachegen-connector-report" for rep in reports)
    assert any(rep.get("save_chunks") for rep in reports)

    # A round-1 request on server 1 whose user's round 0 ran on server 0 and that loaded tokens:
    # server 1 never prefilled that user's question, so they came from server 0's chunks.
    first_server = {r["key"]: r["server"] for r in raw["records"] if r["round"] == 0}
    crossed = [
        r
        for r in raw["records"]
        if r["server"] == 1
        and first_server[r["key"]] == 0
        and (r["report"].get("loaded_tokens") or 0) > 0
    ]
    assert crossed, [r["report"] for r in raw["records"]]
    assert raw["summary"]["connector_hits"] >= len(crossed)
    assert raw["summary"]["loaded_bytes"] > 0
