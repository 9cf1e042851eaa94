"""Evaluate codecs by what they do to the model's answers.

For each window the original KV of the context is extracted once, and the model's
teacher-forced logits and greedy generation with that KV are the reference. Each
:class:`Candidate` (a codec at one level, or any other KV round trip) then replaces the KV
by its decoded version and runs the very same path; :mod:`cachegen_lab.quality.metrics`
compares the two. One pass over the windows serves every candidate, so the expensive
prefill happens once per window.

Every run (the reference and each candidate) replays one KV alone, never as a row of a batch:
on CPUs with AMX, oneDNN's bf16 kernels round differently for every batch size, so a row's
logits depend on how many rows run beside it (by more than half a logit on a real model),
which would make a candidate's score depend on the other candidates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from cachegen.errors import InputError
from cachegen.fitting.replay import continuation_logits, greedy_generate
from cachegen.kv import KVCache
from cachegen.workload.retrieval import ANSWER_TOKENS, answer_is_correct
from cachegen.workload.window import Window
from cachegen_lab.quality.metrics import Reference, Tally, WindowScores, compare_logits

PREFILL_CHUNK = 2048  # bounds attention memory when extracting long contexts
RoundTrip = Callable[[KVCache], tuple[KVCache, float]]  # KV -> (decoded KV, total bits)


@dataclass
class Candidate:
    """One thing to evaluate: ``roundtrip`` encodes and decodes a KV cache and says how many
    bits the encoded form took (everything counted)."""

    codec: str
    level: str
    roundtrip: RoundTrip
    options: dict = field(default_factory=dict)  # what the codec was configured with, for reports


@dataclass
class EvalSettings:
    gen_tokens: int = 64  # greedy tokens per text window (retrieval uses ANSWER_TOKENS)
    gen_windows: int | None = None  # generate on the first N windows only (None: all)
    seed: int = 0  # for the bootstrap intervals


def evaluate(
    model: str,
    windows: list[Window],
    candidates: list[Candidate],
    settings: EvalSettings | None = None,
    *,
    progress: bool = True,
    labels: dict | None = None,
) -> list[dict]:
    """One result row per candidate (see :meth:`Tally.summary` for the fields)."""
    from cachegen.extract import extract_kv, load_model

    settings = settings or EvalSettings()
    if not windows:
        raise InputError("no evaluation windows")
    if not candidates:
        raise InputError("nothing to evaluate: give at least one codec and level")
    hf_model, tokenizer, spec = load_model(model)
    replay = _Replay(hf_model, tokenizer, settings)
    tallies = [Tally() for _ in candidates]
    bar = tqdm(
        total=len(windows) * len(candidates),
        desc=f"eval {spec.name}",
        unit="run",
        disable=not progress,
        leave=False,
    )
    for index, window in enumerate(windows):
        generate = settings.gen_windows is None or index < settings.gen_windows
        kv = extract_kv(model, token_ids=window.context_ids, prefill_chunk_tokens=PREFILL_CHUNK)
        reference = replay.run(kv, window, generate)
        scored = Reference.of(reference.logits, reference.targets)
        # A decoded KV bit-identical to one already run (raw vs the original, int8 vs
        # int8-zstd) reuses that run's outcome: the model is deterministic, so it would
        # repeat it. Outcomes keep no logits (a vocabulary per token is big).
        known = {_digest(kv): _Outcome.of(scored, reference)}
        for candidate, tally in zip(candidates, tallies):
            bar.set_postfix_str(f"{candidate.codec}/{candidate.level}", refresh=False)
            kv_i, bits_i = candidate.roundtrip(kv)
            digest = _digest(kv_i)
            if digest not in known:
                known[digest] = _Outcome.of(scored, replay.run(kv_i, window, generate))
            outcome = known[digest]
            tally.add_window(outcome.scores, bits_i, kv.num_elements)
            if generate:
                tally.add_generation(
                    reference.generated, outcome.generated, reference.text, outcome.text
                )
                if window.answer is not None:
                    tally.add_retrieval(
                        str(window.tags["context_tokens"]),
                        answer_is_correct(reference.text, window.answer),
                        answer_is_correct(outcome.text, window.answer),
                    )
            bar.update()
    bar.close()
    rows = []
    for candidate, tally in zip(candidates, tallies):
        row = {"codec": candidate.codec, "level": candidate.level, **(labels or {})}
        row.update(tally.summary(settings.seed))
        if candidate.options:
            row["options"] = candidate.options
        rows.append(row)
    return rows


def _digest(kv: KVCache) -> bytes:
    """What tells a KV from another: its dtype and every bit of its keys and values."""
    h = hashlib.sha256(str(kv.dtype).encode())
    for x in (kv.keys, kv.values):
        h.update(x.contiguous().view(torch.uint8).numpy())
    return h.digest()


@dataclass
class _Outcome:
    """A run's scores against the reference, and its greedy answer."""

    scores: WindowScores
    generated: list[int]
    text: str

    @classmethod
    def of(cls, reference: Reference, run: _Run) -> _Outcome:
        return cls(compare_logits(reference, run.logits), run.generated, run.text)


@dataclass
class _Run:
    """What the model does with one KV on one window."""

    logits: torch.Tensor
    targets: torch.Tensor
    generated: list[int]
    text: str


@dataclass
class _Replay:
    hf_model: object
    tokenizer: object
    settings: EvalSettings

    def run(self, kv: KVCache, window: Window, generate: bool) -> _Run:
        """Scores and (if ``generate``) greedy answer of ``window`` after ``kv``, alone."""
        logits = continuation_logits(self.hf_model, [kv], window.continuation_ids)[0, :-1]
        generated: list[int] = []
        if generate:
            budget = ANSWER_TOKENS if window.answer is not None else self.settings.gen_tokens
            stop_ids = frozenset(i for i in [self.tokenizer.eos_token_id] if i is not None)
            prompt = window.continuation_ids[: window.prompt_len]
            generated = greedy_generate(self.hf_model, [kv], prompt, budget, stop_ids)[0]
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        return _Run(logits, window.continuation_ids[1:], generated, text)
