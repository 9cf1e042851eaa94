"""KV extraction from a transformers causal LM.

``extract_kv`` runs the model over a token prefix and returns the KV that attention reads:
post-RoPE keys and values of every layer, in the library's logical layout (see ``kv.py``).
Long prefixes are prefilled in chunks through the model's own cache, so activation memory
is bounded by the chunk size while the result equals one-shot extraction.
"""

from __future__ import annotations

import functools

import torch
from tqdm import tqdm

from cachegen.cpu import engine_dtype
from cachegen.errors import InputError, ModelError
from cachegen.kv import KVCache
from cachegen.models import ModelSpec, attention_windows, resolve


@functools.lru_cache(maxsize=4)
def _load(name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = resolve(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load {spec.name} from {spec.path}: {exc}") from exc
    model.eval()
    return model, tokenizer, spec


def model_dtype() -> torch.dtype:
    """The dtype models run in on this CPU: the engines' (``cachegen.cpu.engine_dtype``), as
    bf16 arithmetic without bf16 instructions is several times slower than float32."""
    chosen = engine_dtype()
    return torch.bfloat16 if chosen == "auto" else getattr(torch, chosen)


def load_model(model: str | ModelSpec, dtype: torch.dtype | None = None):
    """``(hf_model, tokenizer, spec)`` for a model name running in ``dtype`` (default
    ``model_dtype()``), cached per process."""
    name = model.name if isinstance(model, ModelSpec) else model
    return _load(name, dtype or model_dtype())


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` as the model sees it at the start of a prompt (with BOS if any)."""
    if not text or not text.strip():
        raise InputError("the text is empty; give some text to prefill")
    return torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)


def extract_kv(
    model: str | ModelSpec,
    text: str | None = None,
    token_ids: torch.Tensor | list[int] | None = None,
    *,
    prefill_chunk_tokens: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = False,
) -> KVCache:
    """KV cache of a prefix given as ``text`` or ``token_ids`` (exactly one of them).

    ``prefill_chunk_tokens`` bounds activation memory for long inputs; ``None`` prefills in
    one pass. The model runs in the wider of ``dtype`` (the KV's) and ``model_dtype()``.
    """
    hf_model, tokenizer, spec = load_model(model, torch.promote_types(dtype, model_dtype()))
    if (text is None) == (token_ids is None):
        raise InputError("give exactly one of text or token_ids")
    ids = (
        tokenize(tokenizer, text)
        if text is not None
        else torch.as_tensor(token_ids, dtype=torch.int64).flatten()
    )
    if ids.numel() == 0:
        raise InputError("no tokens to prefill")
    if ids.numel() > spec.max_positions:
        raise InputError(
            f"{ids.numel()} tokens exceed {spec.name}'s context of {spec.max_positions} tokens; "
            "shorten the text"
        )
    if prefill_chunk_tokens is not None and prefill_chunk_tokens <= 0:
        raise InputError(f"prefill chunk must be positive, got {prefill_chunk_tokens}")
    step = prefill_chunk_tokens or ids.numel()

    from transformers import DynamicCache

    # No config: a cache built from the model's config would keep only the last `window`
    # tokens of sliding-window layers; the KV container holds every token of every layer.
    cache = DynamicCache()
    bounds = range(0, ids.numel(), step)
    with torch.inference_mode():
        for begin in tqdm(
            bounds, desc=f"prefill {spec.name}", unit="chunk", disable=not progress, leave=False
        ):
            piece = ids[begin : begin + step].unsqueeze(0)
            positions = torch.arange(begin, begin + piece.shape[1]).unsqueeze(0)
            # logits of the last position only: the whole context's would cost a vocabulary-wide
            # product per token (Gemma 3's vocabulary has 262,144 entries) and go unused
            hf_model(
                input_ids=piece,
                past_key_values=cache,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return KVCache(
        keys=keys.to(dtype),
        values=values.to(dtype),
        token_ids=ids,
        model=spec.identity(),
        windows=attention_windows(spec.config),
    )
