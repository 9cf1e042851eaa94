"""The fleet's workloads, generated offline from held-out text (``cachegen.workload``, never
the calibration split) and deterministic for a seed.

``multi-round-qa``
    ``users`` users share one system prompt of ``system_tokens`` tokens; each asks ``rounds``
    questions, one per round, each a passage of ``question_tokens`` tokens of its own and a
    question about it. With ``history_tokens``, each user's first question starts with a
    passage of that many tokens of its own (the user's long context, as LMCache's multi-round
    QA gives each user a history). A request's chat is the system prompt, that user's earlier
    questions and the server's actual answers to them (closed loop: round r of a user is sent
    once round r-1 of that user has been answered), and the new question. Requests are listed
    round by round, users in order within a round.
``long-doc-qa``
    ``documents`` documents of ``document_tokens`` tokens each (the system message), each asked
    ``questions`` different questions; the requests are shuffled (seeded), none waits for
    another.

A request's ``after`` is the index of the request whose answer its chat ends with (None: it
depends on none); ``round`` counts the requests of the same user or document before it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from cachegen import workload as texts
from cachegen.errors import InputError

MULTI_ROUND = "multi-round-qa"
LONG_DOC = "long-doc-qa"
WORKLOADS = (MULTI_ROUND, LONG_DOC)
TEMPLATE_TOKENS = 64  # what a chat template adds per message, at most, for the models here


@dataclass(frozen=True)
class Request:
    """One request of a workload: who asks (``key``: ``user-<i>`` or ``doc-<i>``), the system
    message, the new user message, and the request it follows (closed loop)."""

    index: int
    key: str
    round: int
    system: str
    user: str
    after: int | None = None

    def messages(self, history: list[dict[str, str]]) -> list[dict[str, str]]:
        """The chat sent: the system message, ``history`` (earlier turns of the same key),
        this request's question."""
        return [
            {"role": "system", "content": self.system},
            *history,
            {"role": "user", "content": self.user},
        ]


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    settings: dict[str, Any]
    requests: list[Request] = field(default_factory=list)
    prompt_tokens_bound: int = 0  # the longest prompt, without the answers in it

    def keys(self) -> list[str]:
        """Every user or document, in order of first request."""
        return list(dict.fromkeys(r.key for r in self.requests))


def _passages(tokenizer, domain: str, lengths: list[int], rng: random.Random) -> list[str]:
    """Consecutive disjoint passages of ``lengths`` tokens of ``domain``'s held-out text, from
    a seeded offset on."""
    ids = tokenizer(texts.domain_text(domain), add_special_tokens=False)["input_ids"]
    needed = sum(lengths)
    if needed > len(ids):
        raise InputError(
            f"the workload needs {needed} tokens of {domain!r} text but only {len(ids)} are "
            "available; ask for fewer or shorter passages"
        )
    offset = rng.randrange(len(ids) - needed + 1)
    out = []
    for n in lengths:
        out.append(tokenizer.decode(ids[offset : offset + n]))
        offset += n
    return out


def _question(passage: str, number: int) -> str:
    return passage + texts.bench_question(number)


def _positive(**counts: int) -> None:
    for name, value in counts.items():
        if value < 1:
            raise InputError(f"--{name.replace('_', '-')} must be at least 1")


def multi_round_qa(
    tokenizer,
    *,
    users: int,
    rounds: int,
    system_tokens: int,
    question_tokens: int,
    max_tokens: int,
    history_tokens: int = 0,
    seed: int = 0,
    domain: str = "pydoc",
) -> Workload:
    """``users`` x ``rounds`` requests over one shared system prompt (see the module)."""
    _positive(users=users, rounds=rounds, system_tokens=system_tokens)
    _positive(question_tokens=question_tokens, max_tokens=max_tokens)
    if history_tokens < 0:
        raise InputError("--history-tokens must be at least 0")
    rng = random.Random(seed)
    histories = [history_tokens] * users if history_tokens else []
    lengths = [system_tokens, *histories] + [question_tokens] * (users * rounds)
    system, *passages = _passages(tokenizer, domain, lengths, rng)
    history = passages[: len(histories)] or [""] * users
    passages = passages[len(histories) :]
    order = list(range(users * rounds))
    rng.shuffle(order)  # which passage each user gets in each round
    requests = []
    for r in range(rounds):
        for u in range(users):
            index = r * users + u
            requests.append(
                Request(
                    index=index,
                    key=f"user-{u}",
                    round=r,
                    system=system,
                    user=(history[u] if r == 0 else "") + _question(passages[order[index]], r),
                    after=None if r == 0 else index - users,
                )
            )
    per_round = question_tokens + max_tokens + 2 * TEMPLATE_TOKENS
    bound = system_tokens + history_tokens + rounds * per_round
    settings = {
        "users": users,
        "rounds": rounds,
        "system_tokens": system_tokens,
        "history_tokens": history_tokens,
        "question_tokens": question_tokens,
        "domain": domain,
    }
    return Workload(MULTI_ROUND, seed, settings, requests, bound + TEMPLATE_TOKENS)


def long_doc_qa(
    tokenizer,
    *,
    documents: int,
    document_tokens: int,
    questions: int,
    seed: int = 0,
    domain: str = "pydoc",
) -> Workload:
    """``documents`` x ``questions`` requests in a seeded shuffled order (see the module)."""
    _positive(documents=documents, document_tokens=document_tokens, questions=questions)
    rng = random.Random(seed)
    docs = _passages(tokenizer, domain, [document_tokens] * documents, rng)
    pairs = [(d, q) for d in range(documents) for q in range(questions)]
    rng.shuffle(pairs)
    asked = [0] * documents
    requests = []
    for index, (d, q) in enumerate(pairs):
        requests.append(
            Request(
                index=index,
                key=f"doc-{d}",
                round=asked[d],
                system=docs[d],
                user=texts.bench_question(q).strip(),
            )
        )
        asked[d] += 1
    settings = {
        "documents": documents,
        "document_tokens": document_tokens,
        "questions": questions,
        "domain": domain,
    }
    return Workload(LONG_DOC, seed, settings, requests, document_tokens + 2 * TEMPLATE_TOKENS)
