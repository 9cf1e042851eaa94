"""The pass-key task: a random 5-digit key hidden in a long filler text, asked for after it.

The filler is the task's usual one (a few plain sentences, repeated), which mentions no
keys or numbers a model could confuse with the pass key. At a chosen depth of the context, a
sentence states the key; the context's KV is what gets compressed, and the
question after it is computed fresh, like a new query after a cached document. The answer is
read from a greedy continuation primed with "The pass key is", and is correct when its first
number is the key. A codec's loss shows as a drop in accuracy.
"""

from __future__ import annotations

import random

import torch

from cachegen.errors import InputError
from cachegen.workload.window import Window

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
# "The pass key is" is always followed by the key: with "{key} is the pass key." as the second
# sentence, Gemma 3 270M at 4K tokens copied "is the pass key" instead of the key.
NEEDLE = " The pass key is {key}. Remember it. The pass key is {key}."
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_TOKENS = 8
MIN_CONTEXT = 128


def passkey_windows(
    tokenizer, *, lengths: list[int], samples: int, seed: int = 0, max_positions: int | None = None
) -> list[Window]:
    """``samples`` windows for each context length in ``lengths`` (tokens, ``<bos>`` and the
    key's sentence included), at depths cycling through ``DEPTHS``, keys drawn with ``seed``."""
    unit = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if _adds_bos(tokenizer) else []
    windows = []
    for length in lengths:
        if length < MIN_CONTEXT:
            raise InputError(f"a pass-key context of {length} tokens is too short; use >= 128")
        total = length + len(question) + ANSWER_TOKENS
        if max_positions is not None and total > max_positions:
            raise InputError(
                f"a pass-key sample of {length} context tokens needs {total} positions, more "
                f"than the model's {max_positions}; ask for shorter contexts"
            )
        rng = random.Random(f"{seed}:{length}")
        for index in range(samples):
            key = str(rng.randrange(10_000, 100_000))
            depth = DEPTHS[index % len(DEPTHS)]
            needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
            room = length - len(bos) - len(needle)
            text = (unit * (room // len(unit) + 1))[:room]
            at = int(room * depth) // len(unit) * len(unit)  # between two filler sentences
            context = bos + text[:at] + needle + text[at:]
            answer = tokenizer(f" {key}", add_special_tokens=False)["input_ids"]
            windows.append(
                Window(
                    context_ids=torch.tensor(context, dtype=torch.int64),
                    continuation_ids=torch.tensor(question + answer, dtype=torch.int64),
                    source=f"passkey-{length}#{index}",
                    prompt_len=len(question),
                    answer=key,
                    tags={"context_tokens": length, "depth": depth},
                )
            )
    return windows


def _adds_bos(tokenizer) -> bool:
    ids = tokenizer("x")["input_ids"]
    return bool(ids) and tokenizer.bos_token_id is not None and ids[0] == tokenizer.bos_token_id
