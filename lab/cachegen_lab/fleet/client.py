"""One request of the fleet, streamed and timed with the ``openai`` client.

``responses`` (the default) sends the chat to the server's Responses API (``/v1/responses``,
``stream=True``): its content arrives as ``response.output_text.delta`` events (the first one
is the first token) and its last event, ``response.completed``, carries the whole response,
with the connector's report in ``kv_transfer_params`` (a streamed chat completion carries none:
docs/connector.md, "The OpenAI-compatible server"). ``chat`` sends a streamed chat completion
instead (no report). Both are greedy (temperature 0), and store nothing on the server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

RESPONSES = "responses"
CHAT = "chat"
APIS = (RESPONSES, CHAT)


@dataclass
class Answer:
    """What came back; times in seconds of ``time.perf_counter()``."""

    sent: float
    first: float | None = None
    end: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    report: dict[str, Any] | None = None
    error: str | None = None


def _report(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    params = (extra or {}).get("kv_transfer_params") or {}
    return params.get("cachegen")


async def _responses(client, model: str, messages, max_tokens: int, extra, answer) -> None:
    stream = await client.responses.create(
        model=model,
        input=messages,
        max_output_tokens=max_tokens,
        temperature=0,
        stream=True,
        store=False,
        extra_body=extra,
    )
    parts: list[str] = []
    async for event in stream:
        kind = getattr(event, "type", "")
        if kind == "response.output_text.delta" and event.delta:
            if answer.first is None:
                answer.first = time.perf_counter()
            parts.append(event.delta)
        elif kind == "response.completed":
            response = event.response
            if response.usage is not None:
                answer.prompt_tokens = response.usage.input_tokens
                answer.output_tokens = response.usage.output_tokens
                details = response.usage.input_tokens_details
                answer.cached_tokens = getattr(details, "cached_tokens", None)
            answer.report = _report(response.model_extra)
        elif kind in ("error", "response.failed"):
            raise RuntimeError(f"the server's stream failed: {event}")
    answer.text = "".join(parts)


async def _chat(client, model: str, messages, max_tokens: int, extra, answer) -> None:
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    parts: list[str] = []
    async for chunk in stream:
        if chunk.usage is not None:
            answer.prompt_tokens = chunk.usage.prompt_tokens
            answer.output_tokens = chunk.usage.completion_tokens
            details = chunk.usage.prompt_tokens_details
            answer.cached_tokens = getattr(details, "cached_tokens", None)
        for choice in chunk.choices:
            if choice.delta.content:
                if answer.first is None:
                    answer.first = time.perf_counter()
                parts.append(choice.delta.content)
    answer.text = "".join(parts)


async def send(
    client,
    model: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    api: str = RESPONSES,
    extra: dict[str, Any] | None = None,
) -> Answer:
    """Send one streamed greedy request (``extra``: vLLM's fields of the request body, such as
    ``ignore_eos``, ``cache_salt``, ``kv_transfer_params``); a failure of any kind is the
    answer's ``error``."""
    answer = Answer(sent=time.perf_counter())
    try:
        await (_responses if api == RESPONSES else _chat)(
            client, model, messages, max_tokens, extra, answer
        )
    except Exception as exc:  # the bench records every failed request, whatever its kind
        answer.error = repr(exc)
    answer.end = time.perf_counter()
    return answer
