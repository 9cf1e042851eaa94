"""The connector behind vLLM's OpenAI-compatible server, driven by the real ``openai`` client:
a system document asked about three times (non-streaming, streaming right after, and once the
document's chunks are stored), the last one loading the document from the store.

One server (SmolLM2-135M, mode cachegen) serves the whole module. Its store is a fresh
redis-server that requires a password, which the server reads from a file the store URL names,
and its records are signed with a secret it reads from ``store_secret_file``: neither value is on
its command line or in its log. Times to first token are printed (``pytest -rP``), never
asserted.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

from cachegen.connector.errors import ConnectorError
from cachegen.store import open_store, record
from cachegen_lab.bench.openai_server import OpenAIServer, ServerError
from tests.support import configured_redis, private_file

MODEL = "smollm2-135m"
DOCUMENT_TOKENS = 1024  # four chunks: enough for a save and a load to show
MAX_TOKENS = 24
QUESTIONS = (
    "In one sentence, what does the text above explain?",
    "Name one Python statement the text above describes.",
    "What is the main topic of the text above?",
)
SECRET = "store-secret-Jm6t-never-logged"  # what must appear nowhere in the server's log
PASSWORD = "redis-pw-Vb3q-never-logged"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    secrets = tmp_path_factory.mktemp("secrets")
    secret_file = private_file(secrets / "store-secret", SECRET + "\n")
    password_file = private_file(secrets / "redis-password", PASSWORD + "\n")
    with configured_redis(secrets / "redis", f"requirepass {PASSWORD}") as port:
        with OpenAIServer(
            MODEL,
            mode="cachegen",
            store=f"redis://127.0.0.1:{port}/0?password_file={password_file}",
            connector_extra={"store_secret_file": str(secret_file)},
        ) as running:
            yield running


@pytest.fixture(scope="module")
def document() -> tuple[str, int]:
    """About 1K tokens of held-out documentation text, and its length in tokens."""
    from transformers import AutoTokenizer

    from cachegen.models import resolve
    from cachegen_lab.bench.serving import documents

    text = documents(MODEL, 1, DOCUMENT_TOKENS)[0]
    tokenizer = AutoTokenizer.from_pretrained(str(resolve(MODEL).path))
    return text, len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat(document: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": document}, {"role": "user", "content": question}]


def _report(response) -> dict:
    """The connector's report in a non-streaming response (``kv_transfer_params``)."""
    params = response.model_extra.get("kv_transfer_params") or {}
    report = params.get("cachegen")
    assert report is not None, f"no connector report in {response.model_extra}"
    assert (report["schema"], report["version"]) == ("cachegen-connector-report", 2)
    return report


def test_the_server_serves_the_model_under_its_name(server):
    assert [model.id for model in server.client(timeout=60).models.list()] == [server.model]


def test_a_stored_document_is_loaded_by_a_later_question(server, document):
    text, doc_tokens = document
    client = server.client(timeout=1800)
    greedy = {"model": server.model, "max_tokens": MAX_TOKENS, "temperature": 0}

    # (a) question 1, non-streaming: nothing stored yet, the document's chunks get saved
    started = time.perf_counter()
    first = client.chat.completions.create(messages=_chat(text, QUESTIONS[0]), **greedy)
    print(f"question 1: {time.perf_counter() - started:.2f} s to the whole answer")
    assert first.choices[0].message.content.strip()
    report = _report(first)
    assert not report.get("loaded_tokens")
    assert report["save_chunks"] == first.usage.prompt_tokens // 256

    # (b) question 2, streaming, right after: it may or may not find the chunks stored yet
    started = time.perf_counter()
    stream = client.chat.completions.create(
        messages=_chat(text, QUESTIONS[1]), stream=True, **greedy
    )
    ttft, pieces, finish = None, [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - started
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    print(f"question 2 (streamed right after): TTFT {ttft:.3f} s, {len(pieces)} chunks")
    assert len(pieces) > 1, "the answer did not arrive as a stream of chunks"
    assert "".join(pieces).strip()
    assert finish in ("stop", "length")

    # (c) question 3 once the connector's own check finds the document stored: a hit
    server.wait_stored(server.tokenize_chat(_chat(text, QUESTIONS[0])))
    started = time.perf_counter()
    third = client.chat.completions.create(messages=_chat(text, QUESTIONS[2]), **greedy)
    print(f"question 3 (after saving): {time.perf_counter() - started:.2f} s to the whole answer")
    assert third.choices[0].message.content.strip()
    report = _report(third)
    print(f"question 3 report: {report}")
    assert "load_error" not in report and "error" not in report
    assert report["loaded_tokens"] >= 0.9 * doc_tokens, (report, doc_tokens)


def test_neither_the_store_secret_nor_the_redis_password_reaches_the_log(server, document):
    """A request saves and a later one loads, in a key scope of their own (``cache_salt``), on
    the signed, password-protected store: the server's whole log, which shows its
    ``kv_connector_extra_config``, and its command line hold neither value."""
    text, doc_tokens = document
    client = server.client(timeout=1800)
    asked = {"model": server.model, "max_tokens": 2, "temperature": 0}
    salted = {"extra_body": {"cache_salt": "secrets-test"}}
    saving = _chat(text, QUESTIONS[0])
    assert _report(client.chat.completions.create(messages=saving, **asked, **salted))[
        "save_chunks"
    ]
    server.wait_stored(server.tokenize_chat(saving), cache_salt="secrets-test")
    loading = client.chat.completions.create(messages=_chat(text, QUESTIONS[1]), **asked, **salted)
    assert _report(loading)["loaded_tokens"] >= 0.9 * doc_tokens
    with open_store(server.config.store, secret="") as store:  # the records are signed
        entry = next(iter(store.list()))
        assert store.get_record(entry.key, entry.level)[4] == record.VERSION_SIGNED
    log = server.log_path.read_text(errors="replace")
    assert "store_secret_file" in log and "password_file" in log  # vLLM logged the config
    command = " ".join(server.command())
    for value in (SECRET, PASSWORD):
        assert value not in log and value not in command


def test_bad_connector_options_fail_before_the_server_starts():
    with pytest.raises(ConnectorError, match="unknown kv_connector_extra_config keys"):
        OpenAIServer(MODEL, mode="cachegen", connector_extra={"no_such_option": 1})
    with pytest.raises(ConnectorError, match="store_secret_file") as caught:
        OpenAIServer(MODEL, mode="cachegen", connector_extra={"store_secret": SECRET})
    assert SECRET not in str(caught.value)


def test_a_server_that_exits_at_start_reports_its_log_and_leaves_no_process():
    server = OpenAIServer(MODEL, mode="raw", server_args=["--no-such-flag"])
    with pytest.raises(ServerError, match="(?s)exited with status.*--no-such-flag"):
        server.start()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)  # the server's process group is gone


def _listening_sockets_and_processes(group: int) -> tuple[int, int]:
    """The listening TCP sockets held by the processes of process group ``group``, and how
    many processes it has (read from /proc)."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    listening.add(fields[9])  # the socket's inode
    sockets, processes = 0, 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pgrp = int(fh.read().rsplit(")", 1)[1].split()[2])
            if pgrp != group:
                continue
            processes += 1
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in listening:
                    sockets += 1
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # a process or descriptor gone while read
    return sockets, processes


def _raw_chat(server, body: dict) -> dict:
    """A chat completion posted as raw JSON, NaN included (the openai client refuses to send
    one; a hostile client need not)."""
    request = urllib.request.Request(
        f"{server.url}/v1/chat/completions",
        data=json.dumps(body, allow_nan=True).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


HOSTILE_PARAMS = (
    ({"bandwidth_mbps": 1.5}, "bandwidth_mbps"),  # a link rate: the lab's connector only
    ({"rtt_ms": float("nan")}, "rtt_ms"),
    ({"mode": "tcq"}, "mode 'tcq' is not one this engine serves"),
    ({"level": float("nan")}, "level must be a level"),
    ({"mode": "adaptive", "slo_ms": 1e300}, "max_slo_ms"),
    ({"form": "cachegen-11-zipped"}, "unknown form"),
)


def test_a_request_chooses_only_what_the_engine_allows(server, document):
    """Rates, RTTs, a mode the engine does not serve, a NaN level, an absurd time budget, an
    unknown form: each request is answered, its report names the refusal, the server opens no
    listening socket and starts no process, and the next plain request still hits."""
    text, doc_tokens = document
    client = server.client(timeout=1800)
    greedy = {"model": server.model, "max_tokens": 8, "temperature": 0}
    messages = _chat(text, "Summarize the text above in five words.")
    client.chat.completions.create(messages=messages, **greedy)
    server.wait_stored(server.tokenize_chat(messages))
    before = _listening_sockets_and_processes(server.pid)
    for params, refusal in HOSTILE_PARAMS:
        answer = _raw_chat(server, {**greedy, "messages": messages, "kv_transfer_params": params})
        assert answer["choices"][0]["message"]["content"].strip()
        report = answer["kv_transfer_params"]["cachegen"]
        assert refusal in report.get("error", ""), (params, report)
        assert not report.get("loaded_tokens"), (params, report)
    assert _listening_sockets_and_processes(server.pid) == before
    report = _report(client.chat.completions.create(messages=messages, **greedy))
    assert "error" not in report and report["loaded_tokens"] >= 0.9 * doc_tokens, report
