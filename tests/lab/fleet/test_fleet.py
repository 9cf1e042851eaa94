"""``cachegen fleet-bench`` end to end: two tiny-llama vLLM OpenAI-compatible servers in the
``raw`` configuration (the connector over one shared directory store, vLLM's prefix cache on),
three users x three rounds of multi-round QA, round robin, each server's KV cache held to 24
blocks (--kv-cache-blocks), and server 1 stopped (SIGTERM) once six requests have ended. One
configuration only, to keep the suite short: the others differ in the servers' options, not in
the command's path. A user's second round runs on the other server than its first, so the
chunks of its history that the first server stored can only come from the shared store: vLLM's
prefix cache cannot give that reuse. After the stop, every request goes to server 0."""

from __future__ import annotations

import json

from cachegen.cli import main
from cachegen_lab.fleet import summary

USERS, ROUNDS, STOP_AFTER, BLOCKS = 3, 3, 6, 24
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
    "--stop-server", "1",
    "--stop-after", str(STOP_AFTER),
    "--kv-cache-blocks", str(BLOCKS),  # 1 GiB holds 2048 of tiny-llama's blocks
]  # fmt: skip


def test_two_servers_share_one_store_and_every_request_is_recorded(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    assert main([*ARGS, "--json", str(out), "--log-dir", str(tmp_path / "logs")]) == 0
    assert "fleet-bench: raw at unlimited: 0 errors" in capsys.readouterr().err

    doc = json.loads(out.read_text())
    summary.validate(doc)
    assert (doc["schema"], doc["version"]) == ("cachegen-fleet-bench", 6)
    assert doc["failure"] is None and doc["settings"]["kv_cache_blocks"] == BLOCKS
    for i in range(2):  # vLLM says it sized the KV cache to the blocks asked for
        log = (tmp_path / "logs" / f"raw-server{i}.log").read_text()
        assert f"with num_gpu_blocks_override={BLOCKS}" in log
    assert [(c["config"], c["bandwidth_mbps"]) for c in doc["runs"]] == [("raw", None)]
    (raw,) = doc["runs"]
    records = raw["records"]
    assert [r["index"] for r in records] == list(range(USERS * ROUNDS))
    assert [r["error"] for r in records] == [None] * len(records)
    assert [r["routed"] for r in records] == [i % 2 for i in range(len(records))]
    assert raw["summary"]["errors"] == 0 and raw["summary"]["load_errors"] == 0
    for r in records:
        assert r["ttft_s"] is not None and 0 < r["ttft_s"] <= r["end_s"] - r["send_s"]
        # At most --max-tokens: in one CI run vLLM's streamed Responses usage counted 3 of 4
        # for one request despite --ignore-eos; the bench records what the server says.
        assert 1 <= r["output_tokens"] <= 4 and r["prompt_tokens"] > 256
        assert r["answer"]
        assert all(a["server"] == 1 for a in r["attempts"])  # only the stopped one failed

    # The stop: server 1 once, after STOP_AFTER answers; what was sent later went to server 0.
    # With at most 2 requests in flight, at least one of the 9 is sent after the 6th end. Which
    # one depends on which answers come first, so which the router's policy names server 1 for
    # may have been sent before the stop (in one CI run the last round's of user 1 was).
    (stop,) = raw["stops"]
    assert stop["server"] == 1
    assert sorted(r["end_s"] for r in records)[STOP_AFTER - 1] <= stop["at_s"]
    later = [r for r in records if r["send_s"] > stop["at_s"]]
    assert later and all(r["server"] == 0 for r in later)
    assert raw["summary"]["failovers"] == sum(1 for r in records if r["attempts"])
    # A request that server 1 was finishing when it was stopped may end without the
    # connector's report (in one run: 2 of 4 tokens streamed, ended 37 ms after the stop).
    unreported = [r for r in records if r["report"] is None]
    assert all(r["server"] == stop["server"] and r["end_s"] >= stop["at_s"] for r in unreported)
    reports = [r["report"] for r in records if r["report"] is not None]
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
        and ((r["report"] or {}).get("loaded_tokens") or 0) > 0
    ]
    assert crossed, [r["report"] for r in raw["records"]]
    assert raw["summary"]["connector_hits"] >= len(crossed)
    assert raw["summary"]["loaded_bytes"] > 0

    # What the run wrote to the store: whole chunks of one form (tiny-llama has no sliding
    # layers), every one of them read back verified after a server was stopped mid-run.
    stored = raw["store"]
    assert stored["entries"] > 0 and stored["unreadable"] == 0
    assert stored["kinds"] == {
        "full": {"entries": stored["entries"], "payload_bytes": stored["payload_bytes"]}
    }
    assert list(stored["forms"]) == ["raw"] and stored["chunks"] == stored["entries"]
