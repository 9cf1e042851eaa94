"""Chunk keys: a hash chained over token ids, namespaced by the weights an engine runs and the
codec profile.

A key names the chunk ``[i * chunk_tokens, (i + 1) * chunk_tokens)`` of a token sequence and
is ``"<namespace>/<digest>"``:

* ``namespace`` (16 hex shown; the first 16 of ``namespace_digest``, a SHA-256) hashes the
  model identity (name, weights fingerprint, KV geometry), the served weights
  (``cachegen.models.ServedWeights``: a SHA-256 of the full weight files, the hub revision
  vLLM loaded, ``hf_overrides`` and ``quantization``), the codec profile id and the chunk size,
  so two models, two checkpoints of one model (even a retrained one written over the same
  files), two ways of serving it, two codec profiles or two chunkings never read each other's
  entries;
* ``digest`` (40 hex) is ``h_i = sha256(h_{i-1} || int64-LE token ids of chunk i)`` with
  ``h_{-1} = sha256(N)``, or ``sha256(N || "\\0salt\\0" || salt)`` for a salted chain
  (``key_scope``: tenant, cache_salt, LoRA adapter, multimodal items), where ``N`` is the full
  64-hex ``namespace_digest``: it depends on every token up to the chunk's end, so the stored
  chunks of a prompt are found by walking its keys until the first miss.

Stores written before the served weights were keyed (namespaces of the model identity alone,
chains seeded with the 16-hex namespace) are not read: their chunks are recomputed once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from cachegen.store.errors import StoreConfigError

if TYPE_CHECKING:  # a chunk server process reads stores without importing torch
    from cachegen.kv import ModelIdentity
    from cachegen.models import ServedWeights

KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}/[A-Za-z0-9_-]{1,128}\Z")  # $ would take a newline
NAMESPACE_HEX = 16
DIGEST_HEX = 40


def namespace_digest(
    model: ModelIdentity, codec_profile_id: str, chunk_tokens: int, *, weights: ServedWeights
) -> str:
    """The SHA-256 (64 hex) of one (model, served weights, codec profile, chunking): it seeds
    every key chain of theirs; its first 16 hex are the keys' visible ``namespace``."""
    if chunk_tokens <= 0:
        raise StoreConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    ident = json.dumps(
        {
            "model": model.to_dict(),
            "weights": weights.to_dict(),
            "codec_profile": str(codec_profile_id),
            "chunk_tokens": int(chunk_tokens),
        },
        sort_keys=True,
    )
    return hashlib.sha256(ident.encode()).hexdigest()


def namespace(
    model: ModelIdentity, codec_profile_id: str, chunk_tokens: int, *, weights: ServedWeights
) -> str:
    """The 16-hex namespace shared by all chunk keys of one (model, served weights, codec
    profile, chunking): what ``cachegen store ls --prefix`` lists a model's chunks by."""
    return namespace_digest(model, codec_profile_id, chunk_tokens, weights=weights)[:NAMESPACE_HEX]


SCOPE_MAX_CHARS = 128
SCOPE_FORBIDDEN = frozenset("@/\\\0")  # as vLLM's cache_salt rule


def check_scope_part(name: str, value: object) -> None:
    """A tenant or cache_salt is a non-empty string of at most 128 printable characters without
    '@', '/', '\\' (vLLM's rule for cache_salt); anything else is refused."""
    if value is None:
        return
    if (
        not isinstance(value, str)
        or not value
        or len(value) > SCOPE_MAX_CHARS
        or any(c in SCOPE_FORBIDDEN or not c.isprintable() for c in value)
    ):
        if isinstance(value, str):
            shown = repr(value) if len(value) <= 40 else f"of {len(value)} characters"
        else:
            shown = f"of type {type(value).__name__}"
        raise StoreConfigError(
            f"{name} {shown} is not valid: use a non-empty string of at most {SCOPE_MAX_CHARS} "
            "printable characters without '@', '/' or '\\'"
        )


def key_scope(tenant: str | None, cache_salt: str | None, inputs: dict | None = None) -> str | None:
    """The salt of a request's chunk keys: an operator's tenant, a request's cache_salt
    (vLLM's) and ``inputs``, what else makes its KV (a LoRA adapter's fingerprint, multimodal
    items: ``cachegen.connector.inputs``), encoded so that no two different scopes give the
    same salt; None when none is set (the unsalted keys). Without ``inputs`` the salt is what
    it was before inputs were keyed (a scope with none stays the scope it was). A malformed
    tenant or cache_salt raises StoreConfigError."""
    check_scope_part("tenant", tenant)
    check_scope_part("cache_salt", cache_salt)
    if inputs:
        return json.dumps([tenant, cache_salt, inputs], sort_keys=True)
    if tenant is None and cache_salt is None:
        return None
    return json.dumps([tenant, cache_salt])


def chunk_keys(
    model: ModelIdentity,
    codec_profile_id: str,
    token_ids: Sequence[int] | np.ndarray,
    chunk_tokens: int,
    *,
    weights: ServedWeights,
    include_partial: bool = True,
    salt: str | None = None,
) -> list[str]:
    """Keys of the consecutive chunks of ``token_ids`` (a list, numpy array or torch tensor),
    for ``model`` served as ``weights`` (``ModelSpec.served_weights()`` for a model served as
    it is, ``ServedWeights.of_engine`` for what a vLLM engine serves).

    With ``include_partial`` the last, shorter chunk gets a key too; its digest differs from
    any full chunk's, so it only ever matches the exact same tail. A ``salt`` (a tenant's
    scope, e.g. vLLM's ``cache_salt``) seeds the chain, so the same tokens under different
    salts, or with and without one, never share a key; no salt keeps the unsalted keys.
    """
    full = namespace_digest(model, codec_profile_id, chunk_tokens, weights=weights)
    ns = full[:NAMESPACE_HEX]
    ids = np.asarray(token_ids, dtype="<i8").reshape(-1)
    seed = full.encode() if salt is None else full.encode() + b"\0salt\0" + salt.encode()
    state = hashlib.sha256(seed).digest()
    keys = []
    for begin in range(0, len(ids), chunk_tokens):
        piece = ids[begin : begin + chunk_tokens]
        if len(piece) < chunk_tokens and not include_partial:
            break
        state = hashlib.sha256(state + piece.tobytes()).digest()
        keys.append(f"{ns}/{state.hex()[:DIGEST_HEX]}")
    return keys


SLIDING_SUFFIX = "-sliding"


def sliding_key(key: str) -> str:
    """The key of the sliding-window layers' part of the chunk stored under ``key`` (a chunk of
    a model that mixes full and sliding-window attention is stored as two records: its
    full-attention layers under ``key``, its sliding layers under this key)."""
    validate_key(key)
    return validate_key(key + SLIDING_SUFFIX)


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe store key (``NAME/NAME``, letters, digits, ``_``, ``-``)."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise StoreConfigError(
            f"invalid chunk key {key!r}: expected 'namespace/digest' made of letters, digits, "
            "'_' and '-' (use cachegen.store.chunk_keys to derive keys)"
        )
    return key


def validate_level(level: int) -> int:
    if (
        not isinstance(level, (int, np.integer))
        or isinstance(level, bool)
        or not 0 <= int(level) <= 65535
    ):
        raise StoreConfigError(f"invalid quality level {level!r}: expected an integer 0..65535")
    return int(level)
