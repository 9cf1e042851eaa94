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
from dataclasses import asdict, dataclass, replace
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
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ModelIdentity:
        try:
            name, fingerprint = str(data["name"]), str(data["fingerprint"])
            geometry = [int(data[k]) for k in ("num_layers", "num_kv_heads", "head_dim")]
        except (KeyError, TypeError, ValueError) as exc:
            raise KVError(f"model identity is malformed: {exc}") from exc
        return cls(name, fingerprint, *geometry)


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
        _check_geometry(self)
        if self.windows is not None:
            self.windows = _checked_windows(self.windows, self.num_layers)

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
        return replace(
            self,
            keys=self.keys[:, :, begin:end],
            values=self.values[:, :, begin:end],
            token_ids=self.token_ids[begin:end],
            start=self.start + begin,
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
        windows = None if self.windows is None else tuple(self.windows[r] for r in rows)
        return self._with_layers(self.keys, self.values, rows, windows, layers)

    def _with_layers(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: list[int],
        windows: tuple[int | None, ...] | None,
        layers: Iterable[int],
    ) -> KVCache:
        """This cache's tokens with rows ``rows`` of ``keys``/``values`` as the layers
        ``layers``: views when the rows are consecutive, else a copy."""
        first, end = rows[0], rows[0] + len(rows)
        if rows == list(range(first, end)):
            keys, values = keys[first:end], values[first:end]
        else:
            index = torch.tensor(rows, dtype=torch.int64, device=keys.device)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        return replace(self, keys=keys, values=values, windows=windows, layers=tuple(layers))

    @staticmethod
    def merge_layers(parts: Sequence[KVCache]) -> KVCache:
        """Join caches of the same tokens that hold disjoint sets of one model's layers into
        one cache of all their layers (ordered by layer; a full cache if they hold them all).
        ``windows`` is kept only if every part knows it."""
        held = _check_mergeable(parts)
        order = sorted(range(len(held)), key=held.__getitem__)
        keys = torch.cat([p.keys for p in parts]) if len(parts) > 1 else parts[0].keys
        values = torch.cat([p.values for p in parts]) if len(parts) > 1 else parts[0].values
        windows = None
        if all(p.windows is not None for p in parts):
            flat = [w for p in parts for w in p.windows or ()]
            windows = tuple(flat[i] for i in order)
        return parts[0]._with_layers(keys, values, order, windows, [held[i] for i in order])

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
        return replace(
            parts[0],
            keys=torch.cat([p.keys for p in parts], dim=2),
            values=torch.cat([p.values for p in parts], dim=2),
            token_ids=torch.cat([p.token_ids for p in parts]),
            windows=known.pop() if known else None,
        )

    def to(self, dtype: torch.dtype) -> KVCache:
        return replace(self, keys=self.keys.to(dtype), values=self.values.to(dtype))

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
        blob = st_save(
            {
                "keys": self.keys.contiguous(),
                "values": self.values.contiguous(),
                "token_ids": self.token_ids.to(torch.int64).contiguous(),
            }
        )
        meta = json.dumps(_description(self, blob), indent=2) + "\n"
        _write_directory(target, {TENSOR_FILE: blob, META_FILE: meta.encode()})
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
        meta = _read_description(meta_path)
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
        tensors = _read_tensors(blob, tensor_path)
        return cls(
            keys=tensors["keys"],
            values=tensors["values"],
            token_ids=tensors["token_ids"],
            model=model,
            start=int(meta.get("start", 0)),
            windows=meta.get("windows"),
            layers=meta.get("layers"),
        )


def _check_geometry(kv: KVCache) -> None:
    """``KVError`` unless keys, values and token ids fit each other and ``kv.model``."""
    if kv.keys.shape != kv.values.shape:
        raise KVError(
            f"keys {tuple(kv.keys.shape)} and values {tuple(kv.values.shape)} differ in shape"
        )
    if kv.keys.dim() != 4:
        raise KVError(
            f"expected [layers, kv_heads, tokens, head_dim], got shape {tuple(kv.keys.shape)}"
        )
    layers, heads, tokens, head_dim = kv.keys.shape
    present = kv.model.num_layers if kv.layers is None else len(kv.layers)
    expected = (present, kv.model.num_kv_heads, kv.model.head_dim)
    if (layers, heads, head_dim) != expected:
        which = "" if kv.layers is None else f" with layers {list(kv.layers)} selected"
        raise KVError(
            f"KV geometry (layers={layers}, kv_heads={heads}, head_dim={head_dim}) "
            f"does not match model {kv.model.name}{which} (layers={expected[0]}, "
            f"kv_heads={expected[1]}, head_dim={expected[2]})"
        )
    if kv.token_ids.dim() != 1 or kv.token_ids.numel() != tokens:
        raise KVError(f"{kv.token_ids.numel()} token ids for {tokens} tokens of KV")
    if kv.start < 0:
        raise KVError(f"start position must be >= 0, got {kv.start}")


def _checked_windows(windows: Iterable[int | None], layers: int) -> tuple[int | None, ...]:
    out = tuple(windows)
    if len(out) != layers or any(
        w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0) for w in out
    ):
        raise KVError(
            f"windows must give each of the {layers} layers None (full attention) or a "
            f"positive window, got {out!r}"
        )
    return out


def _check_mergeable(parts: Sequence[KVCache]) -> list[int]:
    """The layers the ``parts`` hold, in their order, after checking that they are disjoint
    layers of the same tokens of one model, in one dtype."""
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
    return held


def _describe_layers(layers: tuple[int, ...] | None) -> str:
    return "all layers" if layers is None else f"layers {list(layers)}"


def _description(kv: KVCache, blob: bytes) -> dict:
    """The ``kv.json`` document of ``kv`` whose tensor file is ``blob``."""
    fields = {
        "model": kv.model.to_dict(),
        "start": kv.start,
        "num_tokens": kv.num_tokens,
        "dtype": str(kv.dtype).removeprefix("torch."),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "size": len(blob),
        "windows": None if kv.windows is None else list(kv.windows),
    }
    if kv.layers is not None:
        fields["layers"] = list(kv.layers)
    return versioned(SCHEMA, VERSION, fields)


def _write_directory(target: Path, files: dict[str, bytes]) -> None:
    """``target`` holding ``files``, written into a temporary sibling renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        if target.exists():
            target.rmdir()
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_description(meta_path: Path) -> dict:
    """The checked ``kv.json`` document at ``meta_path`` (version 1 said ``format``)."""
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KVError(f"{meta_path} is not valid JSON: {exc}") from exc
    allowed = (VERSION,)
    if isinstance(meta, dict) and meta.get("format") == SCHEMA and "schema" not in meta:
        meta, allowed = {**meta, "schema": SCHEMA}, (1,)
    if not isinstance(meta, dict) or meta.get("schema") != SCHEMA:
        raise KVError(f"{meta_path} is not a cachegen KV description")
    try:
        check_version(meta, SCHEMA, allowed, str(meta_path))
    except InputError as exc:
        raise KVError(str(exc)) from exc
    return meta


def _read_tensors(blob: bytes, tensor_path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors = st_load(blob)
    except SafetensorError as exc:
        raise KVError(f"{tensor_path} cannot be parsed: {exc}") from exc
    missing = {"keys", "values", "token_ids"} - tensors.keys()
    if missing:
        raise KVError(f"{tensor_path} lacks tensors {sorted(missing)}")
    return tensors
