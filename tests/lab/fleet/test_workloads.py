"""The fleet's workloads, router and summary, without servers: seeded workloads are the same
for a seed and differ across seeds, multi-round QA's closed loop and long-document QA's
shuffled questions, both routers, the summary's counts and the document's schema, the refused
options, a failed warm-up, a failed configuration that leaves the runs before it in the
document, and the servers' command line."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cachegen.errors import InputError
from cachegen_lab.fleet import summary, workloads
from cachegen_lab.fleet.client import Answer
from cachegen_lab.fleet.router import ROUND_ROBIN, STICKY, Router
from tests.lab.fleet.document_support import SETTINGS, setup


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from cachegen.models import resolve

    return AutoTokenizer.from_pretrained(str(resolve("tiny-llama").path))


def _multi(tokenizer, seed: int = 0) -> workloads.Workload:
    return workloads.multi_round_qa(
        tokenizer, users=3, rounds=2, system_tokens=64, question_tokens=32, max_tokens=4, seed=seed
    )


def _docs(tokenizer, seed: int = 0) -> workloads.Workload:
    return workloads.long_doc_qa(tokenizer, documents=3, document_tokens=64, questions=4, seed=seed)


def test_a_seed_makes_one_workload_and_another_seed_another(tokenizer):
    assert _multi(tokenizer, 1) == _multi(tokenizer, 1)
    assert _multi(tokenizer, 1).requests != _multi(tokenizer, 2).requests
    assert _docs(tokenizer, 1) == _docs(tokenizer, 1)
    assert _docs(tokenizer, 1).requests != _docs(tokenizer, 2).requests


def test_multi_round_users_share_the_system_prompt_and_wait_for_their_own_last_answer(
    tokenizer,
):
    work = _multi(tokenizer)
    assert [(r.key, r.round) for r in work.requests] == [
        (f"user-{u}", r) for r in range(2) for u in range(3)
    ]
    assert len({r.system for r in work.requests}) == 1
    assert len({r.user for r in work.requests}) == 6  # a question of its own per user and round
    for r in work.requests:
        if r.round == 0:
            assert r.after is None
        else:
            assert (
                work.requests[r.after].key == r.key and work.requests[r.after].round == r.round - 1
            )
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    messages = work.requests[3].messages(history)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system_ids = tokenizer(work.requests[0].system, add_special_tokens=False)["input_ids"]
    assert abs(len(system_ids) - 64) <= 4  # cut at 64 tokens, re-tokenized


def test_a_user_history_opens_each_users_first_question_and_only_that(tokenizer):
    plain = _multi(tokenizer)
    work = workloads.multi_round_qa(
        tokenizer, users=3, rounds=2, system_tokens=64, question_tokens=32, max_tokens=4,
        history_tokens=100,
    )  # fmt: skip
    assert work.settings["history_tokens"] == 100 and plain.settings["history_tokens"] == 0
    assert work.prompt_tokens_bound == plain.prompt_tokens_bound + 100
    firsts = [r.user for r in work.requests if r.round == 0]
    later = [r.user for r in work.requests if r.round == 1]
    assert len(set(firsts)) == 3 and all(r.system == work.requests[0].system for r in work.requests)
    for first, again in zip(firsts, later):
        tokens = len(tokenizer(first, add_special_tokens=False)["input_ids"])
        assert 100 + 32 <= tokens <= 100 + 32 + 40  # the history, the passage, the question
        assert len(tokenizer(again, add_special_tokens=False)["input_ids"]) < 32 + 40
    with pytest.raises(InputError, match="--history-tokens"):
        workloads.multi_round_qa(
            tokenizer, users=1, rounds=1, system_tokens=8, question_tokens=8, max_tokens=4,
            history_tokens=-1,
        )  # fmt: skip


def test_long_doc_asks_each_document_its_questions_in_a_shuffled_order(tokenizer):
    work = _docs(tokenizer)
    keys = [r.key for r in work.requests]
    assert sorted(keys) == sorted(f"doc-{d}" for d in range(3) for _ in range(4))
    assert keys != sorted(keys)
    for key in set(keys):
        mine = [r for r in work.requests if r.key == key]
        assert [r.round for r in mine] == [0, 1, 2, 3]
        assert len({r.user for r in mine}) == 4 and len({r.system for r in mine}) == 1
    assert all(r.after is None for r in work.requests)


def test_a_workload_longer_than_the_text_is_refused(tokenizer):
    with pytest.raises(InputError, match="tokens of 'pydoc' text"):
        workloads.long_doc_qa(tokenizer, documents=1000, document_tokens=100_000, questions=1)


def test_round_robin_follows_the_request_order_and_sticky_keeps_a_user_on_one_server(tokenizer):
    work = _multi(tokenizer)
    rr = Router(ROUND_ROBIN, 2, work)
    assert [rr.server(r) for r in work.requests] == [0, 1, 0, 1, 0, 1]
    sticky = Router(STICKY, 2, work)
    assert [sticky.server(r) for r in work.requests] == [0, 1, 0, 0, 1, 0]


def test_a_server_marked_down_gets_nothing_and_its_requests_go_to_the_next_live_one(tokenizer):
    work = _multi(tokenizer)
    rr = Router(ROUND_ROBIN, 3, work)
    rr.mark_down(1)
    assert [rr.server(r) for r in work.requests] == [0, 2, 2, 0, 2, 2]
    rr.mark_down(2)
    assert {rr.server(r) for r in work.requests} == {0} and rr.any_live()
    rr.mark_down(0)
    assert not rr.any_live()
    with pytest.raises(RuntimeError, match="every server"):
        rr.server(work.requests[0])


def test_a_run_salts_every_request_and_gives_the_connector_its_link_rate():
    from cachegen_lab.fleet.drive import Run

    shaped = Run("raw", 100.0, "fleet-x-raw-100", connector=True)
    assert shaped.extra_body(ignore_eos=True) == {
        "cache_salt": "fleet-x-raw-100",
        "kv_transfer_params": {"bandwidth_mbps": 100.0},
        "ignore_eos": True,
    }
    assert Run("raw", None, "s", connector=True).extra_body(False) == {"cache_salt": "s"}
    assert Run("prefix-cache", None, "p", connector=False).extra_body(False) == {"cache_salt": "p"}


def test_the_summary_counts_hits_errors_and_servers_and_the_document_validates(tokenizer):
    work = _multi(tokenizer)
    reports = [None, {"loaded_tokens": 0}, {"loaded_tokens": 256, "bytes": 1000}]
    records = []
    for i, request in enumerate(work.requests[:3]):
        answer = Answer(sent=10.0 + i, first=10.5 + i, end=11.0 + i, output_tokens=4)
        answer.report = reports[i]
        answer.error = "boom" if i == 0 else None
        attempts = [{"server": 1, "error": "gone"}] if i == 2 else []
        run = ("raw", 1000.0)
        records.append(
            summary.record(
                run, work.name, request, answer, 10.0, routed=1, server=i % 2, attempts=attempts
            )
        )
    reports[2]["load_error"] = "chunk 1: checksum"
    result = summary.summarize(records, 2, connector=True)
    assert result["errors"] == 1 and result["requests_per_server"] == [2, 1]
    assert result["failovers"] == 1 and result["load_errors"] == 1
    assert result["reports"] == 2 and result["connector_hits"] == 1
    assert result["connector_hit_rate"] == pytest.approx(1 / 3)
    assert (result["loaded_tokens"], result["loaded_bytes"]) == (256, 1000)
    assert result["output_tokens"] == 8 and result["wall_s"] == pytest.approx(3.0)
    run = {"config": "raw", "bandwidth_mbps": 1000.0, "setup": setup("raw", True)}
    tally = {"entries": 3, "payload_bytes": 3000}
    census = {"chunks": 3, **tally, "kinds": {"full": tally}, "forms": {"raw": tally}}
    run |= {"summary": result, "stops": [], "records": records, "store": census | {"unreadable": 0}}
    doc = summary.document(SETTINGS, [run])
    summary.validate(doc)
    assert "| raw | 1000 | 3 | 1 | 1 | - |" in summary.markdown(doc)
    assert summary.markdown(doc).splitlines()[-1].endswith("| 1 | 3 | 3000 | 0 |")
    with pytest.raises(jsonschema.ValidationError):
        summary.validate({**doc, "version": 2})
    # A version 3 document has no store census; this version needs one.
    without = {**doc, "runs": [{k: v for k, v in run.items() if k != "store"}]}
    summary.validate({**without, "version": 3})
    with pytest.raises(jsonschema.ValidationError):
        summary.validate(without)
    # Versions 4 and 5 tallied the census per store slot under `levels`, this version per form
    # name under `forms`; version 4 also called the census's distinct keys `keys`, not `chunks`.
    for version, names in ((5, {"forms": "levels"}), (4, {"forms": "levels", "chunks": "keys"})):
        renamed = {names.get(k, k): v for k, v in run["store"].items()}
        renamed = renamed | {"levels": {"0": tally}}
        older = {**doc, "version": version, "runs": [{**run, "store": renamed}]}
        summary.validate(older)
        with pytest.raises(jsonschema.ValidationError):
            summary.validate({**older, "version": summary.VERSION})
    del records[0]["server"]
    with pytest.raises(jsonschema.ValidationError):
        summary.validate(doc)


def test_each_configuration_gets_a_store_no_other_wrote_and_no_password_is_inline(tmp_path):
    from cachegen_lab.fleet.run import fresh_store

    with fresh_store(tmp_path.as_uri(), "raw", "run1") as (url, extra):
        assert url == (tmp_path / "run1-raw").as_uri() and extra == {}
    with fresh_store(tmp_path.as_uri(), "int8", "run1") as (other, _):
        assert other != url
    with fresh_store(None, "raw", "run1") as (temporary, _):
        assert temporary.startswith("file://")
    named = "redis://127.0.0.1:6379/0?password_file=/run/secrets/redis"
    with fresh_store(named, "raw", "run1") as (redis_url, extra):
        assert redis_url == named and extra == {"tenant": "fleet-run1-raw"}
    # The servers' command lines and logs would show it: refused, with the fix.
    with pytest.raises(InputError, match=r"\?password_file=") as caught:
        with fresh_store("redis://:pw-Kd2@127.0.0.1:6379/0", "raw", "run1"):
            pass
    assert "pw-Kd2" not in str(caught.value)
    with fresh_store("redis+cluster://127.0.0.1:7000", "int8", "run1") as (cluster_url, extra):
        assert cluster_url == "redis+cluster://127.0.0.1:7000"
        assert extra == {"tenant": "fleet-run1-int8"}
    with pytest.raises(InputError, match="file://, redis://"), fresh_store("s3://b", "raw", "r"):
        pass


def test_answers_equal_to_the_recompute_runs_are_counted_per_run():
    def run(config, answers):
        records = [{"index": i, "answer": a, "error": None} for i, a in enumerate(answers)]
        return {"config": config, "summary": {"answers_as_recompute": None}, "records": records}

    runs = [run("recompute", ["a", "b", "c"]), run("raw", ["a", "x", "c"])]
    runs[1]["records"][2]["error"] = "boom"
    summary.compare_answers(runs, "recompute")
    assert [r["summary"]["answers_as_recompute"] for r in runs] == [3, 1]
    alone = [run("raw", ["a"])]
    summary.compare_answers(alone, "recompute")
    assert alone[0]["summary"]["answers_as_recompute"] is None


def test_a_stop_needs_two_servers_one_link_rate_and_a_request_left_after_it():
    from cachegen_lab.fleet.drive import Stop
    from cachegen_lab.fleet.run import _check

    _check(2, 4, 2, [None], Stop(1, 3), 6)
    _check(2, 4, 2, [None], Stop(1, 5), 6)
    for servers, bandwidths, stop in [
        (1, [None], Stop(0, 3)),
        (2, [None], Stop(2, 3)),
        (2, [None], Stop(1, 0)),
        (2, [100.0, None], Stop(1, 3)),
    ]:
        with pytest.raises(InputError, match="stop"):
            _check(servers, 4, 2, bandwidths, stop, 6)
    for after in (6, 7):
        with pytest.raises(InputError, match=f"--stop-after {after}: a run has 6 requests"):
            _check(2, 4, 2, [None], Stop(1, after), 6)
    with pytest.raises(InputError, match="bandwidth"):
        _check(2, 4, 2, [0.0], None, 6)


def test_a_kv_cache_that_cannot_hold_the_longest_request_is_refused_before_any_server():
    from cachegen_lab.fleet.run import _check_server

    _check_server(None, 1, None, 1024)
    _check_server(None, 1, 9, 1024)  # 8 blocks of 128 tokens, and the one vLLM keeps back
    with pytest.raises(InputError, match="--kv-cache-blocks 8: .* 1024 tokens .* at least 9"):
        _check_server(None, 1, 8, 1024)
    with pytest.raises(InputError, match="at least 11"):
        _check_server(None, 1, 10, 1152 + 1)
    with pytest.raises(InputError, match="--kv-cache-gib"):
        _check_server(None, 0, None, 1024)
    with pytest.raises(InputError, match="file://, redis://"):
        _check_server("s3://bucket", 1, None, 1024)


def test_the_library_and_the_command_share_their_defaults():
    import inspect

    from cachegen.cli import build_parser
    from cachegen_lab.fleet.run import fleet_bench

    args = build_parser().parse_args(["fleet-bench"])
    defaults = inspect.signature(fleet_bench).parameters
    for name in ("servers", "max_tokens", "kv_cache_gib", "kv_cache_blocks", "slo_ms", "router"):
        assert getattr(args, name) == defaults[name].default, name


class _Client:
    async def close(self) -> None:
        pass


class _Server:
    model = "tiny-llama"

    def async_client(self, **_) -> _Client:
        return _Client()


def test_a_failed_warm_up_request_is_a_one_line_error_naming_the_run(tokenizer, monkeypatch):
    import asyncio

    from cachegen.errors import CacheGenError
    from cachegen_lab.fleet import drive

    async def refused(*_, **__) -> Answer:
        return Answer(sent=0.0, error="APIConnectionError(message='Connection error.')")

    monkeypatch.setattr(drive.client, "send", refused)
    run = drive.Run("raw", 100.0, "salt", connector=True)
    with pytest.raises(CacheGenError) as caught:
        sending = drive.Sending(concurrency=2, max_tokens=4, api="responses")
        asyncio.run(drive.warm_up([_Server(), _Server()], _multi(tokenizer), sending, run))
    assert str(caught.value) == (
        "raw at 100: the warm-up request on server 0 failed: "
        "APIConnectionError(message='Connection error.')"
    )


def _fake_runs(monkeypatch, fail: str):
    """Runs without servers: ``start_fleet`` starts nothing (its keyword arguments are kept
    in the list returned), every request of a run answers "a", and the warm-up of
    configuration ``fail`` fails."""
    from cachegen_lab.fleet import run as fleet_run
    from cachegen_lab.fleet.drive import FleetError

    started: list[dict] = []

    def start_fleet(stack, model, config, count, **kwargs):
        started.append({"config": config.name, **kwargs})
        return [None] * count

    def run_one(bench, fleet, run, store):
        if run.config == fail:
            raise FleetError(f"{run.label}: the warm-up request on server 1 failed: boom")
        records = [
            summary.record(
                (run.config, run.bandwidth_mbps),
                bench.work.name,
                request,
                Answer(sent=1.0, first=1.5, end=2.0, text="a", prompt_tokens=90, output_tokens=4),
                1.0,
                routed=0,
                server=0,
                attempts=[],
            )
            for request in bench.work.requests
        ]
        result = summary.summarize(records, bench.servers, connector=run.connector)
        return {"summary": result, "stops": [], "records": records, "store": None}

    monkeypatch.setattr(fleet_run, "start_fleet", start_fleet)
    monkeypatch.setattr(fleet_run, "run_one", run_one)
    return started


FAILING = [
    "fleet-bench",
    "--model", "tiny-llama",
    "--configs", "recompute", "raw", "int8", "default",
    "--users", "3",
    "--rounds", "1",
    "--system-tokens", "64",
    "--question-tokens", "32",
    "--bandwidth-mbps", "100", "unlimited",
    "--store", "redis://127.0.0.1:1/0?password_env=FLEET_REDIS_PASSWORD",
    "--kv-cache-blocks", "40",
]  # fmt: skip


def test_a_failed_configuration_keeps_the_runs_before_it_and_exits_with_one_line(
    tmp_path, monkeypatch, capsys
):
    from cachegen.cli import main

    started = _fake_runs(monkeypatch, fail="int8")
    out = tmp_path / "fleet.json"
    assert main([*FAILING, "--json", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"cachegen fleet-bench: error: configuration int8 failed (the 3 runs before it are in "
        f"{out}): int8 at 100: the warm-up request on server 1 failed: boom"
    )
    doc = json.loads(out.read_text())
    summary.validate(doc)
    assert doc["version"] == 6
    assert doc["failure"] == {
        "config": "int8",
        "error": "int8 at 100: the warm-up request on server 1 failed: boom",
    }
    runs = [(r["config"], r["bandwidth_mbps"]) for r in doc["runs"]]
    assert runs == [("recompute", None), ("raw", 100.0), ("raw", None)]
    assert [s["config"] for s in started] == ["recompute", "raw", "int8"]  # default never ran

    # The tenant of the Redis store, per configuration; none without the connector.
    recompute, raw, _ = doc["runs"]
    assert recompute["setup"]["tenant"] is None and recompute["setup"]["store"] is None
    assert raw["setup"]["tenant"].startswith("fleet-") and raw["setup"]["tenant"].endswith("-raw")
    assert raw["setup"]["store"] == "redis://127.0.0.1:1/0?password_env=FLEET_REDIS_PASSWORD"
    assert [s["store_extra"] for s in started[1:]] == [
        {"tenant": raw["setup"]["tenant"]},
        {"tenant": raw["setup"]["tenant"][: -len("raw")] + "int8"},
    ]

    # One KV cache size for every server, recorded.
    settings = doc["settings"]
    assert (settings["kv_cache_gib"], settings["kv_cache_blocks"], settings["max_tokens"]) == (
        1,
        40,
        16,
    )
    for s in started:
        assert s["server_args"] == ("--num-gpu-blocks-override", "40")
        assert s["env"] == {"VLLM_CPU_KVCACHE_SPACE": "1"}
    assert [r["summary"]["answers_as_recompute"] for r in doc["runs"]] == [3, 3, 3]


def test_the_table_shows_answers_as_recompute_prompt_tokens_and_the_failure(monkeypatch, capsys):
    from cachegen.cli import main

    _fake_runs(monkeypatch, fail="default")
    assert main(FAILING) == 1
    out, err = capsys.readouterr()
    assert "| failovers | as recompute | TTFT p50 (ms) |" in out
    assert "| per server | prompt tokens | cached tokens |" in out
    assert "| int8 | 100 | 3 | 0 | 0 | 3 | 500 | 500 | 500 |" in out
    assert "| 3 / 0 | 270 | 0 |" in out
    assert out.rstrip().endswith(
        "Ended early: default failed: default at 100: the warm-up request on server 1 failed: boom"
    )
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("cachegen fleet-bench: error: configuration default failed: default at 100:")
    )


def test_every_server_of_a_fleet_gets_the_kv_cache_blocks_on_its_command_line(
    tmp_path, monkeypatch
):
    import contextlib

    from cachegen_lab.bench.openai_server import OpenAIServer
    from cachegen_lab.fleet import configs
    from cachegen_lab.fleet.run import server_args, start_fleet

    monkeypatch.setattr(OpenAIServer, "start", lambda self: self)
    assert server_args(None) == ()
    with contextlib.ExitStack() as stack:
        fleet = start_fleet(
            stack,
            "tiny-llama",
            configs.config("raw", "tiny-llama"),
            2,
            store=tmp_path.as_uri(),
            store_extra={},
            max_model_len=1024,
            env={"VLLM_CPU_KVCACHE_SPACE": "1"},
            server_args=server_args(40),
            log_dir=None,
        )
        for server in fleet:
            command = server.command()
            at = command.index("--num-gpu-blocks-override")
            assert command[at + 1] == "40" and "--enable-prefix-caching" in command
