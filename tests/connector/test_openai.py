"""The connector behind vLLM's OpenAI-compatible server, driven by the real ``openai`` client:
a system document asked about three times (non-streaming, streaming right after, and once the
document's chunks are stored), the last one loading the document from the store.

One server (SmolLM2-135M, mode cachegen, a fresh file store) serves the whole module. Times to
first token are printed (``pytest -rP``), never asserted.
"""

from __future__ import annotations

import os
import time

import pytest

from cachegen.connector.errors import ConnectorError
from cachegen_lab.bench.openai_server import OpenAIServer, ServerError

MODEL = "smollm2-135m"
DOCUMENT_TOKENS = 1024  # four chunks: enough for a save and a load to show
MAX_TOKENS = 24
QUESTIONS = (
    "In one sentence, what does the text above explain?",
    "Name one Python statement the text above describes.",
    "What is the main topic of the text above?",
)


@pytest.fixture(scope="module")
def server():
    with OpenAIServer(MODEL, mode="cachegen") as running:
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
    assert (report["schema"], report["version"]) == ("cachegen-connector-report", 1)
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


def test_bad_connector_options_fail_before_the_server_starts():
    with pytest.raises(ConnectorError, match="unknown kv_connector_extra_config keys"):
        OpenAIServer(MODEL, mode="cachegen", connector_extra={"no_such_option": 1})


def test_a_server_that_exits_at_start_reports_its_log_and_leaves_no_process():
    server = OpenAIServer(MODEL, mode="raw", server_args=["--no-such-flag"])
    with pytest.raises(ServerError, match="(?s)exited with status.*--no-such-flag"):
        server.start()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)  # the server's process group is gone
