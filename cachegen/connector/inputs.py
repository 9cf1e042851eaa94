"""What besides the token ids makes a request's KV: the part of its chunk keys' scope that
comes from vLLM's ``Request``.

The same tokens give other KV under a LoRA adapter (on k_proj/v_proj it changes every layer's
keys and values) and at multimodal placeholders (the same placeholder ids for different
images). So a request's key scope (``cachegen.store.keys.key_scope``) carries:

* ``lora``: the adapter's fingerprint, a SHA-256 over the names and bytes of the files in its
  directory (its content, not its name: two servers may load other weights under one name),
  computed once per adapter directory and file state;
* ``mm``: each multimodal item's modality, vLLM identifier (a hash of its content, or the
  user's uuid) and placeholder position, in prompt order.

Requests whose KV the connector cannot name are refused (``InputsRefused``): neither loaded
nor saved, with the reason in their report: ``prompt_embeds`` requests (their placeholder
tokens say nothing of the embeddings) and adapters whose files this process cannot read.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request


class InputsRefused(Exception):
    """The request's KV depends on something its key cannot name; ``reason`` says what."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def request_inputs(request: Request) -> dict[str, Any] | None:
    """The key-scope part of ``request`` beyond tokens, tenant and cache_salt; None when there
    is none (the keys of a plain text request stay what they always were)."""
    if getattr(request, "prompt_embeds", None) is not None:
        raise InputsRefused(
            "prompt_embeds",
            "prompt_embeds request: its KV is not determined by its token ids, so the "
            "connector neither loads nor saves it",
        )
    inputs: dict[str, Any] = {}
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        inputs["lora"] = adapter_fingerprint(lora.lora_path, lora.lora_name)
    features = getattr(request, "mm_features", None) or []
    if features:
        inputs["mm"] = [
            [f.modality, f.identifier, f.mm_position.offset, f.mm_position.length]
            for f in sorted(features, key=lambda f: f.mm_position.offset)
        ]
    return inputs or None


def adapter_fingerprint(path: str, name: str = "") -> str:
    """SHA-256 (hex) of the adapter directory's files, names and bytes, in sorted order;
    recomputed only when a file's size or modification time changes."""
    root = Path(path).expanduser()
    try:
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else []
        stats = [(p, p.stat()) for p in files]
        state = tuple((str(p.relative_to(root)), st.st_size, st.st_mtime_ns) for p, st in stats)
        if files:
            return _fingerprint(str(root.resolve()), state)
        why = "no files"
    except OSError as exc:  # a file replaced or removed while it was read, or unreadable
        why = f"files that cannot be read ({type(exc).__name__}: {exc.strerror or exc})"
    raise InputsRefused(
        "adapter_unreadable",
        f"LoRA adapter {name!r}: {why} at {path!r} in this process, so its KV cannot be keyed "
        "by its weights; the connector neither loads nor saves it (give vLLM a local adapter "
        "directory)",
    )


@functools.lru_cache(maxsize=64)
def _fingerprint(root: str, state: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for relative, size, _ in state:
        digest.update(f"{relative}\0{size}\0".encode())
        with open(Path(root) / relative, "rb") as file:
            for block in iter(functools.partial(file.read, 1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
