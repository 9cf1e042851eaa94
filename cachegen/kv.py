"""The KV container: one logical layout for the KV cache of a token prefix.

Logical layout (used everywhere inside the library; backend layouts are translated only in
``cachegen.connector``):

    keys   : torch.Tensor [num_layers, num_kv_heads, num_tokens, head_dim]
    values : torch.Tensor [num_layers, num_kv_heads, num_tokens, head_dim]

Keys are post-RoPE (what attention actually reads). ``token_ids`` are the ids of the
``num_tokens`` tokens, and ``start`` is the position of the first of them in the full
prompt (non-zero for a slice), so a chunk knows where it belongs. ``windows`` records each
layer's attention: ``None`` for full attention, else the sliding window in tokens (a layer
that never reads keys older than that); every layer keeps the KV of every token regardless.
KV decoded from a bitstream does not know it (``windows`` is ``None``: not recorded).

A cache may hold only some of its model's layers: ``layers`` lists the absolute indices
(strictly increasing) of the layers its tensors hold, in that order, and ``None`` means all
of ``model.num_layers`` (a list naming every layer is stored as ``None``). ``model`` stays
the full model's identity, ``num_layers`` counts the layers present, and ``windows`` (if
known) has one entry per layer present. :meth:`KVCache.select_layers` takes such a subset
and :meth:`KVCache.merge_layers` joins subsets of the same tokens back together. Models with
sliding-window layers need those layers' KV only for the last ``window`` tokens, which is
what subsets are for.

On disk a KV cache is a directory with ``kv.safetensors`` (keys, values, token_ids) and
``kv.json`` (metadata plus the SHA-256 of the tensor file). Nothing is ever pickled.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from cachegen.errors import InputError, KVError
from cachegen.fileio import check_version, versioned

SCHEMA = "cachegen-kv"
VERSION = 2  # version 1 named its schema in a "format" field; still read
TENSOR_FILE = "kv.safetensors"
META_FILE = "kv.json"


@dataclass(frozen=True)
class ModelIdentity:
    """What a KV cache belongs to. Two caches are interchangeable only if these match."""

    name: str
    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "fingerprint": self.fingerprint,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }

    @classmethod
    def from_dict(cls, data: dict) -> ModelIdentity:
        try:
            return cls(
                name=str(data["name"]),
                fingerprint=str(data["fingerprint"]),
                num_layers=int(data["num_layers"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KVError(f"model identity is malformed: {exc}") from exc


def check_layers(layers: Iterable[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a tuple of ints after checking that it is a non-empty, strictly increasing
    list of layer indices of a model with ``num_layers`` layers (``KVError`` otherwise)."""
    if isinstance(layers, (str, bytes)):
        raise KVError(f"layers must be a list of layer indices, got {layers!r}")
    try:
        items = list(layers)
        if any(isinstance(i, bool) for i in items):
            raise TypeError("a bool is not a layer index")
        out = tuple(operator.index(i) for i in items)
    except TypeError as exc:
        raise KVError(f"layers must be a list of integer layer indices, got {layers!r}") from exc
    if not out:
        raise KVError("a layer subset must name at least one layer")
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise KVError(f"layer {bad[0]} is out of range: the model has layers 0..{num_layers - 1}")
    for a, b in zip(out, out[1:]):
        if b <= a:
            raise KVError(
                f"layers must be strictly increasing (no repeats), got {a} before {b} "
                f"in {list(out)}"
            )
    return out


@dataclass
class KVCache:
    """KV of ``num_tokens`` consecutive tokens starting at position ``start``, of all of the
    model's layers or (``layers``) of some of them."""

    keys: torch.Tensor
    values: torch.Tensor
    token_ids: torch.Tensor
    model: ModelIdentity
    start: int = 0
    windows: tuple[int | None, ...] | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.layers is not None:
            self.layers = check_layers(self.layers, self.model.num_layers)
            if len(self.layers) == self.model.num_layers:
                self.layers = None  # every layer, in order: the full cache
        if self.keys.shape != self.values.shape:
            raise KVError(
                f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} "
                "differ in shape"
            )
        if self.keys.dim() != 4:
            raise KVError(
                f"expected [layers, kv_heads, tokens, head_dim], got shape {tuple(self.keys.shape)}"
            )
        layers, heads, tokens, head_dim = self.keys.shape
        present = self.model.num_layers if self.layers is None else len(self.layers)
        expected = (present, self.model.num_kv_heads, self.model.head_dim)
        if (layers, heads, head_dim) != expected:
            which = "" if self.layers is None else f" with layers {list(self.layers)} selected"
            raise KVError(
                f"KV geometry (layers={layers}, kv_heads={heads}, head_dim={head_dim}) "
                f"does not match model {self.model.name}{which} (layers={expected[0]}, "
                f"kv_heads={expected[1]}, head_dim={expected[2]})"
            )
        if self.token_ids.dim() != 1 or self.token_ids.numel() != tokens:
            raise KVError(f"{self.token_ids.numel()} token ids for {tokens} tokens of KV")
        if self.start < 0:
            raise KVError(f"start position must be >= 0, got {self.start}")
        if self.windows is not None:
            self.windows = tuple(self.windows)
            if len(self.windows) != layers or any(
                w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0)
                for w in self.windows
            ):
                raise KVError(
                    f"windows must give each of the {layers} layers None (full attention) or a "
                    f"positive window, got {self.windows!r}"
                )

    @property
    def num_layers(self) -> int:
        """Layers held (all of the model's, or those of ``layers``)."""
        return self.keys.shape[0]

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """Absolute index of each layer held, in tensor order."""
        return tuple(range(self.model.num_layers)) if self.layers is None else self.layers

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def head_dim(self) -> int:
        return self.keys.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def num_elements(self) -> int:
        """Elements in keys and values together (the denominator of bits/element)."""
        return 2 * self.keys.numel()

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def slice(self, begin: int, end: int) -> KVCache:
        """Tokens ``[begin, end)`` relative to this cache (views, no copy)."""
        if not 0 <= begin <= end <= self.num_tokens:
            raise KVError(f"token range [{begin}, {end}) is outside 0..{self.num_tokens}")
        return KVCache(
            keys=self.keys[:, :, begin:end],
            values=self.values[:, :, begin:end],
            token_ids=self.token_ids[begin:end],
            model=self.model,
            start=self.start + begin,
            windows=self.windows,
            layers=self.layers,
        )

    def chunks(self, chunk_tokens: int) -> list[KVCache]:
        """Consecutive slices of at most ``chunk_tokens`` tokens."""
        if chunk_tokens <= 0:
            raise KVError(f"chunk_tokens must be positive, got {chunk_tokens}")
        return [
            self.slice(i, min(i + chunk_tokens, self.num_tokens))
            for i in range(0, self.num_tokens, chunk_tokens)
        ]

    def select_layers(self, layers: Iterable[int]) -> KVCache:
        """The cache restricted to ``layers`` (absolute, strictly increasing indices, each held
        by this cache); views when the layers are consecutive, else a copy. ``windows`` is
        restricted alike."""
        layers = check_layers(layers, self.model.num_layers)
        held = self.layer_indices
        position = {layer: i for i, layer in enumerate(held)}
        missing = [i for i in layers if i not in position]
        if missing:
            raise KVError(f"layer {missing[0]} is not in this cache (it holds layers {list(held)})")
        rows = [position[i] for i in layers]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            keys = self.keys[rows[0] : rows[0] + len(rows)]
            values = self.values[rows[0] : rows[0] + len(rows)]
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=self.keys.device)
            keys = self.keys.index_select(0, index)
            values = self.values.index_select(0, index)
        return KVCache(
            keys=keys,
            values=values,
            token_ids=self.token_ids,
            model=self.model,
            start=self.start,
            windows=None if self.windows is None else tuple(self.windows[r] for r in rows),
            layers=layers,
        )

    @staticmethod
    def merge_layers(parts: Sequence[KVCache]) -> KVCache:
        """Join caches of the same tokens that hold disjoint sets of one model's layers into
        one cache of all their layers (ordered by layer; a full cache if they hold them all).
        ``windows`` is kept only if every part knows it."""
        if not parts:
            raise KVError("no layer subsets to merge")
        first = parts[0]
        for part in parts[1:]:
            if part.model != first.model:
                raise KVError(
                    f"cannot merge layers of model {part.model.name} into KV of {first.model.name}"
                )
            if (
                part.start != first.start
                or part.num_tokens != first.num_tokens
                or not torch.equal(part.token_ids.cpu(), first.token_ids.cpu())
            ):
                raise KVError("cannot merge layers of different tokens (start or token ids differ)")
            if part.dtype != first.dtype:
                raise KVError(f"cannot merge layers of dtypes {first.dtype} and {part.dtype}")
        held = [layer for part in parts for layer in part.layer_indices]
        seen: set[int] = set()
        for layer in held:
            if layer in seen:
                raise KVError(f"layer {layer} is in more than one of the parts to merge")
            seen.add(layer)
        order = sorted(range(len(held)), key=held.__getitem__)
        keys = torch.cat([p.keys for p in parts]) if len(parts) > 1 else first.keys
        values = torch.cat([p.values for p in parts]) if len(parts) > 1 else first.values
        if order != list(range(len(held))):
            index = torch.tensor(order, dtype=torch.int64, device=keys.device)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        windows = None
        if all(p.windows is not None for p in parts):
            flat = [w for p in parts for w in p.windows or ()]
            windows = tuple(flat[i] for i in order)
        return KVCache(
            keys=keys,
            values=values,
            token_ids=first.token_ids,
            model=first.model,
            start=first.start,
            windows=windows,
            layers=tuple(held[i] for i in order),
        )

    @staticmethod
    def concat(parts: list[KVCache]) -> KVCache:
        """Join consecutive slices (of the same layers) back into one cache."""
        if not parts:
            raise KVError("nothing to concatenate")
        for prev, nxt in zip(parts, parts[1:]):
            if nxt.start != prev.start + prev.num_tokens or nxt.model != prev.model:
                raise KVError("slices are not consecutive pieces of one model's KV")
            if nxt.layers != prev.layers:
                raise KVError(
                    "slices hold different layers "
                    f"({_describe_layers(prev.layers)} and {_describe_layers(nxt.layers)}); "
                    "concatenate slices of the same layers, then merge_layers"
                )
        known = {p.windows for p in parts if p.windows is not None}
        if len(known) > 1:
            raise KVError("slices disagree on the layers' attention windows")
        return KVCache(
            keys=torch.cat([p.keys for p in parts], dim=2),
            values=torch.cat([p.values for p in parts], dim=2),
            token_ids=torch.cat([p.token_ids for p in parts]),
            model=parts[0].model,
            start=parts[0].start,
            windows=known.pop() if known else None,
            layers=parts[0].layers,
        )

    def to(self, dtype: torch.dtype) -> KVCache:
        return KVCache(
            self.keys.to(dtype),
            self.values.to(dtype),
            self.token_ids,
            self.model,
            self.start,
            self.windows,
            self.layers,
        )

    def summary(self) -> dict:
        """Shape and identity; ``layers`` is present only for a layer subset."""
        out = {
            "model": self.model.name,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_tokens": self.num_tokens,
            "start": self.start,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes": self.nbytes,
            "windows": None if self.windows is None else list(self.windows),
        }
        if self.layers is not None:
            out["layers"] = list(self.layers)
        return out

    # ---- persistence -------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``kv.safetensors`` and ``kv.json`` into ``directory`` atomically.

        The files are written into a temporary sibling directory that is renamed into place,
        so an interrupted save never leaves a directory that later loads. A layer subset
        records its layers in ``kv.json`` (``"layers"``, written only for a subset, so the
        files of full caches are unchanged).
        """
        target = Path(directory)
        if target.exists() and any(target.iterdir()):
            raise KVError(f"{target} exists and is not empty; choose a new output directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        blob = st_save(
            {
                "keys": self.keys.contiguous(),
                "values": self.values.contiguous(),
                "token_ids": self.token_ids.to(torch.int64).contiguous(),
            }
        )
        fields = {
            "model": self.model.to_dict(),
            "start": self.start,
            "num_tokens": self.num_tokens,
            "dtype": str(self.dtype).removeprefix("torch."),
            "sha256": hashlib.sha256(blob).hexdigest(),
            "size": len(blob),
            "windows": None if self.windows is None else list(self.windows),
        }
        if self.layers is not None:
            fields["layers"] = list(self.layers)
        meta = versioned(SCHEMA, VERSION, fields)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            (tmp / TENSOR_FILE).write_bytes(blob)
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            if target.exists():
                target.rmdir()
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target

    @classmethod
    def load(
        cls, directory: str | os.PathLike, expect_model: ModelIdentity | None = None
    ) -> KVCache:
        """Read a cache written by :meth:`save`, verifying checksum, shapes and model."""
        directory = Path(directory)
        meta_path, tensor_path = directory / META_FILE, directory / TENSOR_FILE
        if not meta_path.is_file() or not tensor_path.is_file():
            raise KVError(
                f"{directory} is not a KV directory (expected {META_FILE} and {TENSOR_FILE})"
            )
        try:
            meta = json.loads(meta_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise KVError(f"{meta_path} is not valid JSON: {exc}") from exc
        allowed = (VERSION,)
        if isinstance(meta, dict) and meta.get("format") == SCHEMA and "schema" not in meta:
            meta, allowed = {**meta, "schema": SCHEMA}, (1,)  # version 1 said "format"
        if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
            raise KVError(f"{meta_path} is not a cachegen KV description")
        try:
            check_version(meta, SCHEMA, allowed, str(meta_path))
        except InputError as exc:
            raise KVError(str(exc)) from exc
        blob = tensor_path.read_bytes()
        if len(blob) != meta.get("size") or hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
            raise KVError(
                f"{tensor_path} is corrupt or truncated (size or checksum mismatch); "
                "extract the KV again"
            )
        model = ModelIdentity.from_dict(meta.get("model", {}))
        if expect_model is not None and model != expect_model:
            raise KVError(
                f"{directory} holds KV of model {model.name} ({model.fingerprint[:12]}), "
                f"not {expect_model.name} ({expect_model.fingerprint[:12]})"
            )
        try:
            tensors = st_load(blob)
        except SafetensorError as exc:
            raise KVError(f"{tensor_path} cannot be parsed: {exc}") from exc
        missing = {"keys", "values", "token_ids"} - tensors.keys()
        if missing:
            raise KVError(f"{tensor_path} lacks tensors {sorted(missing)}")
        return cls(
            keys=tensors["keys"],
            values=tensors["values"],
            token_ids=tensors["token_ids"],
            model=model,
            start=int(meta.get("start", 0)),
            windows=meta.get("windows"),
            layers=meta.get("layers"),
        )


def _describe_layers(layers: tuple[int, ...] | None) -> str:
    return "all layers" if layers is None else f"layers {list(layers)}"
