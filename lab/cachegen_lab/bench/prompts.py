"""The prompts of the sweep: contexts cut from text that ships with CPython, plus a question.

Each context length gets its own disjoint slice of the Python documentation text
(``pydoc_data.topics``, the evaluation split that the codec's profile never saw), so a
longer context never starts with a shorter one that is already stored. Each repeat asks a
different question after the same context, so only the context can come from a cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from cachegen import workload
from cachegen.errors import InputError

TEXT_SOURCE = f"{workload.SOURCE}, evaluation split"


@dataclass(frozen=True)
class Context:
    tokens: int
    ids: tuple[int, ...]

    def prompt(self, question_ids: list[int]) -> list[int]:
        return list(self.ids) + list(question_ids)


def contexts(tokenizer, lengths: list[int]) -> list[Context]:
    ids = tokenizer(workload.text("eval"))["input_ids"]
    needed = sum(lengths)
    if needed > len(ids):
        raise InputError(
            f"the contexts need {needed} tokens of text but only {len(ids)} are available; "
            "ask for fewer"
        )
    out, offset = [], 0
    for n in lengths:
        out.append(Context(n, tuple(ids[offset : offset + n])))
        offset += n
    return out


def question(tokenizer, repeat: int) -> list[int]:
    """Token ids of the question asked after the context in repeat ``repeat`` (distinct per
    repeat)."""
    return tokenizer(workload.bench_question(repeat), add_special_tokens=False)["input_ids"]
