"""Random-weight models from small configs with a fixed seed, for fast tests. head_dim is 64
because vLLM's CPU attention rejects smaller heads. They borrow SmolLM2's tokenizer (read
from the GGUF, no weight conversion needed)."""

from __future__ import annotations

from pathlib import Path

from cachegen.model_files.gguf import smollm2_gguf_path

TINY_SEED = 1234

TINY_CONFIGS: dict[str, dict] = {
    "tiny-llama": {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "tiny-opt": {
        "model_type": "opt",
        "hidden_size": 256,
        "ffn_dim": 512,
        "word_embed_proj_dim": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
    },
    "tiny-qwen2": {
        "model_type": "qwen2",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
    },
}


def make_tiny(name: str, out: Path) -> None:
    """The tiny model ``name`` (one of ``TINY_CONFIGS``) written into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    params = dict(TINY_CONFIGS[name])
    model_type = params.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
        **params,
    )
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
