"""LongChat-style "lines" retrieval, generated procedurally with a fixed seed.

Each sample is a record of lines ``line <word>-<word>: REGISTER_CONTENT is <number>``
followed by a question about one of them. The record (with the chat preamble) is the
context whose KV gets compressed; the question is computed fresh on top of it, the way a
cached document is followed by a new query. The assistant turn is primed with
``The <REGISTER_CONTENT> in line X is <`` so even a small model answers with just the
number, which is then compared with the truth.
"""

from __future__ import annotations

import random
import re

import torch

from cachegen.errors import InputError
from cachegen.workload.window import Window

ADJECTIVES = (
    "ancient amber bold brave bright calm clever cold cosmic crimson curious dark eager early "
    "empty fancy fierce gentle giant golden grand green happy hidden hollow humble icy jolly "
    "keen lazy little lively lonely lucky magic mellow mighty misty modern noble odd orange "
    "pale polite proud purple quick quiet rapid rare royal rusty sacred shiny silent silver "
    "simple sleepy smooth solid spicy steady stormy sunny swift tall tender tiny vivid wild"
).split()
NOUNS = (
    "anchor apple arrow badger banjo barrel beacon bison candle canyon castle cedar comet "
    "copper coral desert dragon engine falcon feather forest fountain galaxy garden glacier "
    "harbor hammer helmet island jacket jungle kettle lantern lemon magnet maple meadow mirror "
    "needle oasis ocean orbit otter paddle parrot pebble pepper pillow planet quartz rabbit "
    "rocket saddle signal spider summit tiger tunnel valley violin walrus willow window zebra"
).split()

PREAMBLE = (
    "Below is a record of lines I want you to remember. Each line begins with 'line <line index>' "
    "and contains a '<REGISTER_CONTENT>' at the end of the line as a numerical value. "
    "For each line index, memorize its corresponding <REGISTER_CONTENT>. "
    "At the end of the record, I will ask you to retrieve the corresponding <REGISTER_CONTENT> "
    "of a certain line index. Now the record start:\n\n"
)
QUESTION = (
    "\nNow the record is over. Tell me what is the <REGISTER_CONTENT> in line {name}? "
    "I need the number."
)
ANSWER_PRIME = "The <REGISTER_CONTENT> in line {name} is <"
ANSWER_TOKENS = 12  # generous for a number of up to 5 digits plus '>'


def line_names(rng: random.Random, count: int) -> list[str]:
    pairs = [f"{a}-{n}" for a in ADJECTIVES for n in NOUNS]
    if count > len(pairs):
        raise InputError(f"at most {len(pairs)} distinct lines per record, asked for {count}")
    return rng.sample(pairs, count)


def _split_prompt(
    tokenizer, record: str, question: str, prime: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids of the context (chat preamble + record) and of the query part after it."""
    marker = "\x00QUESTION\x00"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": PREAMBLE + record + marker + question}]
        full = (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            + prime
        )
    else:
        full = PREAMBLE + record + marker + question + "\n" + prime
    context, query = full.split(marker)
    context_ids = tokenizer(context)["input_ids"]
    query_ids = tokenizer(query, add_special_tokens=False)["input_ids"]
    return torch.tensor(context_ids, dtype=torch.int64), torch.tensor(query_ids, dtype=torch.int64)


def make_sample(tokenizer, context_tokens: int, rng: random.Random, index: int) -> Window:
    """One sample whose context has as many whole lines as fit in ``context_tokens`` tokens."""
    budget = context_tokens - len(_split_prompt(tokenizer, "", "", "")[0])
    names = line_names(rng, len(ADJECTIVES) * len(NOUNS))
    lines: list[tuple[str, int]] = []
    for name in names:
        number = rng.randrange(10_000, 50_000)
        cost = len(
            tokenizer(f"line {name}: REGISTER_CONTENT is <{number}>\n", add_special_tokens=False)[
                "input_ids"
            ]
        )
        if cost > budget:
            break
        budget -= cost
        lines.append((name, number))
    if len(lines) < 2:
        raise InputError(
            f"a retrieval context of {context_tokens} tokens holds fewer than two lines; "
            "make it longer"
        )
    record = "".join(f"line {name}: REGISTER_CONTENT is <{number}>\n" for name, number in lines)
    target = rng.randrange(len(lines))
    name, number = lines[target]
    context, query = _split_prompt(
        tokenizer, record, QUESTION.format(name=name), ANSWER_PRIME.format(name=name)
    )
    answer_ids = torch.tensor(
        tokenizer(f"{number}>", add_special_tokens=False)["input_ids"], dtype=torch.int64
    )
    return Window(
        context_ids=context,
        continuation_ids=torch.cat([query, answer_ids]),
        source=f"retrieval-{context_tokens}#{index}",
        prompt_len=query.numel(),
        answer=str(number),
        tags={"context_tokens": context_tokens, "lines": len(lines), "line_index": target},
    )


def retrieval_windows(
    tokenizer, *, lengths: list[tuple[int, int]], seed: int = 0, max_positions: int | None = None
) -> list[Window]:
    """``samples`` samples for each ``(context tokens, samples)`` of ``lengths``, seeded per
    length."""
    windows = []
    for length, samples in lengths:
        if length < 128:
            raise InputError(f"retrieval context of {length} tokens is too short; use at least 128")
        rng = random.Random(f"{seed}:{length}")
        for i in range(samples):
            window = make_sample(tokenizer, length, rng, i)
            total = window.context_ids.numel() + window.continuation_ids.numel() + ANSWER_TOKENS
            if max_positions is not None and total > max_positions:
                raise InputError(
                    f"a retrieval sample of {length} context tokens needs {total} positions, "
                    f"more than the model's {max_positions}; use shorter --retrieval-lengths"
                )
            windows.append(window)
    return windows


def default_lengths(max_positions: int) -> list[int]:
    """Context lengths from 1K tokens doubling up to the model's limit (minus room for the
    query)."""
    top = max_positions - 128
    lengths = []
    length = 1024
    while length < top:
        lengths.append(length)
        length *= 2
    lengths.append(top)
    return lengths


NUMBER = re.compile(r"\d+")


def answer_is_correct(generated_text: str, answer: str) -> bool:
    """True when the first number in the generated answer is the expected one."""
    found = NUMBER.search(generated_text)
    return found is not None and found.group(0) == answer
