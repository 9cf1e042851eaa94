"""Evaluation data that works offline on a fresh machine, as :class:`Window` lists.

:func:`load_windows` maps a dataset name to windows. Sources:
  * ``pydoc``: the workload's Python documentation text (:mod:`cachegen.workload`), its
    ``eval`` split by default or its ``calibrate`` split (for choosing codec levels); the
    split the codec's tables were calibrated on is never used, and ``eval`` shares no text
    with the other two.
  * ``prose``, ``code``, ``dialogue``: the workload's other evaluation domains
    (:func:`cachegen.workload.domain_text`), held out from the calibration text like ``eval``.
  * ``retrieval``: a LongChat-style "lines" task generated with a fixed seed (see
    :mod:`cachegen.workload.retrieval`).
  * a user file: plain UTF-8 text, or JSONL whose records hold ``"text"`` (a document to cut
    windows from) or ``"context"`` and ``"continuation"`` (one window each).

Windows from a token stream are sampled with a fixed seed; their scored continuations never
overlap each other (contexts may share text).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from cachegen import workload
from cachegen.errors import InputError
from cachegen.workload.passkey import passkey_windows
from cachegen.workload.retrieval import default_lengths, retrieval_windows
from cachegen.workload.window import Window

SPLITS = ("eval", "calibrate")  # the workload splits that windows are cut from (pydoc only)
DOMAINS = workload.DOMAINS  # evaluation text domains; `pydoc` also takes a split
TASKS = ("retrieval", "passkey")  # answer-scored tasks; their lengths: --retrieval-lengths


def windows_from_stream(
    ids: torch.Tensor,
    *,
    context_tokens: int,
    continuation_tokens: int,
    count: int,
    seed: int,
    source: str,
) -> list[Window]:
    """``count`` windows from one token stream, with disjoint scored continuations.

    The stream is cut into consecutive continuation slots of ``continuation_tokens + 1``
    tokens after the first ``context_tokens``; ``count`` slots are drawn with ``seed`` and
    each takes the ``context_tokens`` right before it as its context.
    """
    if context_tokens < 1 or continuation_tokens < 1:
        raise InputError("context and continuation must each have at least one token")
    span = continuation_tokens + 1
    slots = (ids.numel() - context_tokens) // span
    if slots < 1:
        raise InputError(
            f"{source} has {ids.numel()} tokens, fewer than one window of {context_tokens} "
            f"context + {span} continuation tokens; lower --context-tokens or give more text"
        )
    if count > slots:
        raise InputError(
            f"{source} holds at most {slots} windows of {context_tokens}+{span} tokens; "
            f"ask for fewer windows or shorter contexts"
        )
    chosen = sorted(random.Random(seed).sample(range(slots), count))
    windows = []
    for slot in chosen:
        begin = context_tokens + slot * span
        windows.append(
            Window(
                context_ids=ids[begin - context_tokens : begin].clone(),
                continuation_ids=ids[begin : begin + span].clone(),
                source=f"{source}@{begin}",
            )
        )
    return windows


def pydoc_windows(tokenizer, *, split: str = "eval", **cut) -> list[Window]:
    """Windows from the workload's Python documentation text, its ``split`` (``source``:
    ``pydoc-split@begin``); ``cut``: :func:`windows_from_stream`'s count, lengths and seed
    (0 unless given)."""
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return _text_windows(workload.text(split), tokenizer, source=f"pydoc-{split}", **cut)


def domain_windows(domain: str, tokenizer, **cut) -> list[Window]:
    """Windows from the held-out text of evaluation ``domain`` (``source``: ``domain@begin``);
    ``cut``: :func:`windows_from_stream`'s count, lengths and seed (0 unless given)."""
    return _text_windows(workload.domain_text(domain), tokenizer, source=domain, **cut)


def _text_windows(text: str, tokenizer, *, source: str, seed: int = 0, **cut) -> list[Window]:
    """Windows cut (:func:`windows_from_stream`) from ``text`` as ``tokenizer`` reads it."""
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
    return windows_from_stream(ids, source=source, seed=seed, **cut)


def file_windows(path: Path, tokenizer, *, count: int, **cut) -> list[Window]:
    """Windows from a UTF-8 text file or a JSONL file (see the module docstring); ``cut``:
    :func:`windows_from_stream`'s lengths and seed."""
    if not path.is_file():
        raise InputError(
            f"dataset {path} is not a file; use one of {', '.join(DOMAINS + TASKS)} or a path "
            "to a text/JSONL file"
        )
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text: {exc}") from exc
    if not raw.strip():
        raise InputError(f"{path} is empty")
    if path.suffix.lower() != ".jsonl":
        return _text_windows(raw, tokenizer, source=path.name, count=count, **cut)
    documents, explicit = [], []
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{lineno} is not valid JSON: {exc.msg}") from exc
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            documents.append(record["text"])
        elif (
            isinstance(record, dict)
            and isinstance(record.get("context"), str)
            and isinstance(record.get("continuation"), str)
        ):
            explicit.append(_explicit_window(tokenizer, record, f"{path.name}:{lineno}"))
        else:
            raise InputError(
                f'{path}:{lineno}: each JSONL record needs a "text" string, or "context" and '
                '"continuation" strings'
            )
    if documents and explicit:
        raise InputError(
            f'{path} mixes "text" records and "context"/"continuation" records; use one kind '
            "per file"
        )
    if explicit:
        return explicit[:count]
    return _text_windows("\n\n".join(documents), tokenizer, source=path.name, count=count, **cut)


def _explicit_window(tokenizer, record: dict, source: str) -> Window:
    context = torch.tensor(tokenizer(record["context"])["input_ids"], dtype=torch.int64)
    continuation = torch.tensor(
        tokenizer(record["continuation"], add_special_tokens=False)["input_ids"], dtype=torch.int64
    )
    if context.numel() == 0 or continuation.numel() < 2:
        raise InputError(f"{source}: the context needs a token and the continuation at least two")
    return Window(context_ids=context, continuation_ids=continuation, source=source)


@dataclass
class DataSettings:
    dataset: str = "pydoc"
    windows: int = 16  # windows in total; for retrieval, samples per context length
    context_tokens: int = 1024
    continuation_tokens: int = 128
    # (context tokens, samples or None for `windows`); None: 1K doubling up to the model's limit
    retrieval_lengths: list[tuple[int, int | None]] | None = None
    seed: int = 0
    split: str = "eval"  # pydoc only: "eval" or "calibrate"; other domains have no split

    def describe(self) -> dict:
        out = {"dataset": self.dataset, "seed": self.seed}
        if self.dataset in TASKS:
            out["retrieval_lengths"] = [list(pair) for pair in self.retrieval_lengths or []]
        else:
            out.update(
                context_tokens=self.context_tokens, continuation_tokens=self.continuation_tokens
            )
            if self.dataset == "pydoc":
                out["split"] = self.split
        return out


def load_windows(settings: DataSettings, tokenizer, max_positions: int) -> list[Window]:
    if settings.windows < 1:
        raise InputError(f"--windows must be at least 1, got {settings.windows}")
    if settings.dataset in TASKS:
        pairs = settings.retrieval_lengths or [(n, None) for n in default_lengths(max_positions)]
        settings.retrieval_lengths = [(n, settings.windows if k is None else k) for n, k in pairs]
        if settings.dataset == "retrieval":
            return retrieval_windows(
                tokenizer,
                lengths=settings.retrieval_lengths,
                seed=settings.seed,
                max_positions=max_positions,
            )
        return [
            window
            for length, samples in settings.retrieval_lengths
            for window in passkey_windows(
                tokenizer,
                lengths=[length],
                samples=samples,
                seed=settings.seed,
                max_positions=max_positions,
            )
        ]
    if settings.context_tokens + settings.continuation_tokens + 1 > max_positions:
        raise InputError(
            f"{settings.context_tokens} context + {settings.continuation_tokens + 1} continuation "
            f"tokens exceed the model's {max_positions} positions; lower --context-tokens"
        )
    common = dict(
        count=settings.windows,
        context_tokens=settings.context_tokens,
        continuation_tokens=settings.continuation_tokens,
        seed=settings.seed,
    )
    if settings.dataset == "pydoc":
        return pydoc_windows(tokenizer, split=settings.split, **common)
    if settings.dataset in DOMAINS:
        if settings.split != "eval":
            raise InputError(
                f"split {settings.split!r} exists only for dataset 'pydoc'; dataset "
                f"{settings.dataset!r} is evaluation text only"
            )
        return domain_windows(settings.dataset, tokenizer, **common)
    return file_windows(Path(settings.dataset), tokenizer, **common)
