"""One evaluation case.

``context_ids`` is the prefix whose KV gets compressed; ``continuation_ids`` is fed after it
with that KV as the past. Predictions of ``continuation_ids[1:]`` are scored, and greedy
generation starts after ``continuation_ids[:prompt_len]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Window:
    """One evaluation case; see the module docstring for how its parts are used."""

    context_ids: torch.Tensor
    continuation_ids: torch.Tensor
    source: str
    prompt_len: int = 1
    answer: str | None = None  # expected answer (retrieval task)
    tags: dict = field(default_factory=dict)
