"""Evaluate codecs by what they do to the model's answers.

For each window the original KV of the context is extracted once, and the model's
teacher-forced logits and greedy generation with that KV are the reference. Each
:class:`Candidate` (a codec at one level, or any other KV round trip) then replaces the KV
by its decoded version and runs the very same path; :mod:`cachegen.lab.quality.metrics`
compares the two. One pass over the windows serves every candidate, so the expensive
prefill happens once per window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from cachegen.errors import InputError
from cachegen.kv import KVCache
from cachegen.lab.quality.metrics import Reference, Tally, compare_logits
from cachegen.lab.quality.replay import continuation_logits, greedy_generate
from cachegen.workload.retrieval import ANSWER_TOKENS, answer_is_correct
from cachegen.workload.window import Window

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
    batch_tokens: int = 65536  # past tokens replayed together (rows x context), bounds memory


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
        rows_per_batch = max(1, settings.batch_tokens // max(1, kv.num_tokens))
        known = _KnownRuns()
        reference = None
        for begin in range(0, len(candidates), rows_per_batch):
            batch = list(range(begin, min(begin + rows_per_batch, len(candidates))))
            decoded, bits = [], []
            for i in batch:
                bar.set_postfix_str(f"{candidates[i].codec}/{candidates[i].level}", refresh=False)
                kv_i, bits_i = candidates[i].roundtrip(kv)
                decoded.append(kv_i)
                bits.append(bits_i)
            # The original KV rides along in the first batch: it is the reference run. A
            # decoded KV bit-identical to one already run (raw vs the original, int8 vs
            # int8-zstd) reuses that run: the model is deterministic, so it would repeat it.
            fresh = []
            for kv_i in ([kv] if reference is None else []) + decoded:
                if known.entry(kv_i) is None:
                    known.add(kv_i)
                    fresh.append(kv_i)
            for kv_i, run in zip(fresh, replay.run(fresh, window, generate) if fresh else []):
                known.entry(kv_i)[1] = run
            if reference is None:
                reference = known.entry(kv)[1]
                scored = Reference.of(reference.logits, reference.targets)
            runs = [known.entry(kv_i)[1] for kv_i in decoded]
            known.keep_only(kv)
            for i, run, bits_i in zip(batch, runs, bits):
                tally = tallies[i]
                tally.add_window(compare_logits(scored, run.logits), bits_i, kv.num_elements)
                if generate:
                    tally.add_generation(
                        reference.generated, run.generated, reference.text, run.text
                    )
                    if window.answer is not None:
                        tally.add_retrieval(
                            str(window.tags["context_tokens"]),
                            answer_is_correct(reference.text, window.answer),
                            answer_is_correct(run.text, window.answer),
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


class _KnownRuns:
    """Runs of one window, found by the exact KV they were (or will be) made with."""

    def __init__(self) -> None:
        self._entries: dict[tuple, list[list]] = {}  # cheap fingerprint -> [[kv, run], ...]

    @staticmethod
    def _print(kv: KVCache) -> tuple:
        return (
            kv.dtype,
            float(kv.keys.sum(dtype=torch.float64)),
            float(kv.values.sum(dtype=torch.float64)),
        )

    def add(self, kv: KVCache) -> None:
        self._entries.setdefault(self._print(kv), []).append([kv, None])

    def entry(self, kv: KVCache) -> list | None:
        for entry in self._entries.get(self._print(kv), []):
            other = entry[0]
            if other is kv or (
                torch.equal(other.keys, kv.keys) and torch.equal(other.values, kv.values)
            ):
                return entry
        return None

    def keep_only(self, kv: KVCache) -> None:
        """Forget every run but ``kv``'s (decoded KVs of long contexts are big)."""
        entry = self.entry(kv)
        self._entries = {self._print(kv): [entry]} if entry else {}


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

    def run(self, kvs: list[KVCache], window: Window, generate: bool) -> list[_Run]:
        """Scores and (if ``generate``) greedy answers of ``window`` after each of ``kvs``."""
        logits = continuation_logits(self.hf_model, kvs, window.continuation_ids)[:, :-1]
        generated: list[list[int]] = [[] for _ in kvs]
        if generate:
            budget = ANSWER_TOKENS if window.answer is not None else self.settings.gen_tokens
            stop_ids = frozenset(i for i in [self.tokenizer.eos_token_id] if i is not None)
            prompt = window.continuation_ids[: window.prompt_len]
            generated = greedy_generate(self.hf_model, kvs, prompt, budget, stop_ids)
        targets = window.continuation_ids[1:]
        return [
            _Run(
                logits[r],
                targets,
                generated[r],
                self.tokenizer.decode(generated[r], skip_special_tokens=True),
            )
            for r in range(len(kvs))
        ]
