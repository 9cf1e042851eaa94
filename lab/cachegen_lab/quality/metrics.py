"""Quality metrics comparing a model run on decoded KV with the same run on the original KV.

Per window, :func:`compare_logits` turns the two runs' teacher-forced logits into sums
(negative log-likelihoods, agreements, KL) that :class:`Tally` accumulates over windows;
answer-level scores (exact match, ROUGE-L, BLEU, retrieval accuracy) compare the greedy
generations. Everything is summed first and divided once, so a row's numbers are
token-weighted over all its windows.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

BOOTSTRAP_SAMPLES = 1000


@dataclass
class WindowScores:
    """Teacher-forced sums for one window (``tokens`` scored positions)."""

    tokens: int
    nll_original: float
    nll: float
    agree: int
    kl: float


@dataclass
class Reference:
    """The original run's next-token log-probabilities (float32) and the scored targets."""

    logp: torch.Tensor  # [n, vocab]
    top1: torch.Tensor  # [n]
    targets: torch.Tensor  # [n]
    nll: float

    @classmethod
    def of(cls, logits: torch.Tensor, targets: torch.Tensor) -> Reference:
        if logits.shape[0] != targets.numel():
            raise ValueError(f"{logits.shape[0]} rows of logits for {targets.numel()} targets")
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = float(-logp.gather(1, targets.view(-1, 1)).double().sum())
        return cls(logp=logp, top1=logits.argmax(dim=-1), targets=targets, nll=nll)


def compare_logits(reference: Reference, logits: torch.Tensor) -> WindowScores:
    """Score the decoded run's ``logits`` (rows aligned with ``reference.targets``).

    KL is KL(original || decoded) of the next-token distributions, in nats, summed over rows.
    """
    if logits.shape != reference.logp.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match the reference {tuple(reference.logp.shape)}"
        )
    logq = torch.log_softmax(logits.float(), dim=-1)
    p = reference.logp.exp()
    kl = (p * (reference.logp - logq)).sum(dim=-1).clamp_min(0.0)
    return WindowScores(
        tokens=reference.targets.numel(),
        nll_original=reference.nll,
        nll=float(-logq.gather(1, reference.targets.view(-1, 1)).double().sum()),
        agree=int((reference.top1 == logits.argmax(dim=-1)).sum()),
        kl=float(kl.double().sum()),
    )


class _WhitespaceTokenizer:
    """ROUGE over whitespace-separated words: code keeps its punctuation (rouge-score's
    default tokenizer drops every non-alphanumeric character)."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 (rouge-score). Two identical texts score 1.0, even if they have no words."""
    if reference == candidate:
        return 1.0
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WhitespaceTokenizer())
    return float(scorer.score(reference, candidate)["rougeL"].fmeasure)


def corpus_bleu(references: list[str], candidates: list[str]) -> float:
    """Corpus BLEU (sacrebleu, 0-100) of the candidates against the references."""
    if not references:
        return float("nan")
    if references == candidates and any(r.strip() for r in references):
        return 100.0  # sacrebleu gives 100 here too, except for texts shorter than 4 words
    import sacrebleu

    return float(sacrebleu.corpus_bleu(candidates, [references]).score)


@dataclass
class Tally:
    """Running sums for one (codec, level) over all windows."""

    windows: int = 0
    bits: float = 0.0
    elements: int = 0
    per_window: list[WindowScores] = field(default_factory=list)
    generations: int = 0
    exact: int = 0
    rouge_sum: float = 0.0
    references: list[str] = field(default_factory=list)
    candidates: list[str] = field(default_factory=list)
    retrieval: dict[str, list[int]] = field(
        default_factory=dict
    )  # tag -> [correct original, correct decoded, n]

    def add_window(self, scores: WindowScores, bits: float, elements: int) -> None:
        self.windows += 1
        self.bits += bits
        self.elements += elements
        self.per_window.append(scores)

    def add_generation(
        self, reference_ids: list[int], candidate_ids: list[int], reference: str, candidate: str
    ) -> None:
        self.generations += 1
        self.exact += int(reference_ids == candidate_ids)
        self.rouge_sum += rouge_l(reference, candidate)
        self.references.append(reference)
        self.candidates.append(candidate)

    def add_retrieval(self, tag: str, correct_original: bool, correct: bool) -> None:
        counts = self.retrieval.setdefault(tag, [0, 0, 0])
        counts[0] += int(correct_original)
        counts[1] += int(correct)
        counts[2] += 1

    def summary(self, seed: int = 0) -> dict:
        tokens = sum(w.tokens for w in self.per_window)
        if tokens == 0:
            raise ValueError("no scored tokens")
        nll_o = sum(w.nll_original for w in self.per_window)
        nll_d = sum(w.nll for w in self.per_window)
        ppl_o, ppl_d = math.exp(nll_o / tokens), math.exp(nll_d / tokens)
        row = {
            "bits_per_element": self.bits / self.elements if self.elements else float("nan"),
            "ppl_original": ppl_o,
            "ppl": ppl_d,
            "ppl_change_pct": 100.0 * (ppl_d / ppl_o - 1.0),
            "ppl_change_ci95": _bootstrap_ci(self.per_window, seed),
            "top1_agreement": sum(w.agree for w in self.per_window) / tokens,
            "kl": sum(w.kl for w in self.per_window) / tokens,
            "windows": self.windows,
            "tokens_scored": tokens,
            "generations": self.generations,
            "exact_match": self.exact / self.generations if self.generations else None,
            "rougeL": self.rouge_sum / self.generations if self.generations else None,
            "bleu": corpus_bleu(self.references, self.candidates) if self.generations else None,
        }
        row["ratio_vs_fp16"] = 16.0 / row["bits_per_element"] if self.elements else None
        if self.retrieval:
            original = sum(c[0] for c in self.retrieval.values())
            decoded = sum(c[1] for c in self.retrieval.values())
            n = sum(c[2] for c in self.retrieval.values())
            row["retrieval_accuracy_original"] = original / n
            row["retrieval_accuracy"] = decoded / n
            row["retrieval_accuracy_original_ci95"] = wilson_ci(original, n)
            row["retrieval_accuracy_ci95"] = wilson_ci(decoded, n)
            row["retrieval_by_length"] = {
                tag: {"original": c[0] / c[2], "decoded": c[1] / c[2], "samples": c[2]}
                for tag, c in sorted(self.retrieval.items(), key=lambda kv: int(kv[0]))
            }
        return row


def wilson_ci(successes: int, trials: int, z: float = 1.959964) -> list[float]:
    """95% Wilson score interval of a proportion: unlike the normal approximation it stays
    inside [0, 1] and is not empty at 0 or ``trials`` successes (e.g. 20 of 20)."""
    if trials <= 0:
        raise ValueError("no trials")
    p = successes / trials
    denominator = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denominator
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denominator
    return [max(0.0, center - half), min(1.0, center + half)]


def _bootstrap_ci(per_window: list[WindowScores], seed: int) -> list[float] | None:
    """95% bootstrap interval (over windows) of the perplexity change in percent."""
    if len(per_window) < 2:
        return None
    rng = random.Random(seed)
    changes = []
    n = len(per_window)
    for _ in range(BOOTSTRAP_SAMPLES):
        sample = [per_window[rng.randrange(n)] for _ in range(n)]
        tokens = sum(w.tokens for w in sample)
        diff = (sum(w.nll for w in sample) - sum(w.nll_original for w in sample)) / tokens
        changes.append(100.0 * math.expm1(diff))
    changes.sort()
    return [changes[int(0.025 * BOOTSTRAP_SAMPLES)], changes[int(0.975 * BOOTSTRAP_SAMPLES) - 1]]
