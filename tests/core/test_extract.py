"""KV extraction from transformers models, and the `cachegen extract` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cachegen.errors import InputError
from cachegen.extract import extract_kv, load_model
from cachegen.kv import KVCache

TEXT = "CacheGen compresses the KV cache of long contexts so it can be streamed quickly. " * 12


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_opt", "tiny_qwen2", "smollm2", "gemma3"])
def test_kv_shapes_match_the_model(request, fixture):
    spec = request.getfixturevalue(fixture)
    kv = extract_kv(spec, text=TEXT)
    identity = spec.identity()
    assert kv.keys.shape == (
        identity.num_layers,
        identity.num_kv_heads,
        kv.num_tokens,
        identity.head_dim,
    )
    assert kv.model == identity and kv.dtype == torch.bfloat16
    assert kv.num_tokens > 100 and kv.token_ids[0].item() >= 0


def test_smollm2_geometry(smollm2):
    kv = extract_kv(smollm2, text=TEXT)
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim) == (30, 3, 64)
    assert kv.windows == (None,) * 30


def test_gemma3_keeps_every_token_of_its_sliding_window_layers(gemma3, tmp_path):
    """A sliding-window layer reads only its last 512 keys, but the container holds them all
    (a model-configured cache would drop the older ones), and records the windows."""
    from cachegen import workload

    ids = load_model(gemma3)[1](workload.text("eval"))["input_ids"][:700]
    kv = extract_kv(gemma3, token_ids=ids, prefill_chunk_tokens=256)
    assert (kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.num_tokens) == (18, 1, 256, 700)
    assert kv.windows == ((512,) * 5 + (None,)) * 3
    assert kv.keys[0, :, :100].abs().sum() > 0  # the oldest tokens of a sliding layer
    again = KVCache.load(kv.save(tmp_path / "kv"))
    assert again.windows == kv.windows and again.summary()["windows"][5] is None
    assert kv.slice(600, 700).windows == kv.windows


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_opt", "smollm2"])
def test_chunked_prefill_equals_one_shot(request, fixture):
    spec = request.getfixturevalue(fixture)
    # float32 isolates the chunking logic from bf16 rounding differences between kernels.
    one = extract_kv(spec, text=TEXT, dtype=torch.float32)
    chunked = extract_kv(spec, text=TEXT, dtype=torch.float32, prefill_chunk_tokens=37)
    assert torch.equal(one.token_ids, chunked.token_ids)
    torch.testing.assert_close(chunked.keys, one.keys, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(chunked.values, one.values, atol=2e-4, rtol=1e-4)


def test_keys_are_post_rope(tiny_llama):
    """The same token at two positions has the same value vector in layer 0 but rotated keys."""
    model, tokenizer, _ = load_model(tiny_llama)
    token = tokenizer(" apple", add_special_tokens=False)["input_ids"][0]
    kv = extract_kv(tiny_llama, token_ids=[token] * 6, dtype=torch.float32)
    torch.testing.assert_close(kv.values[0, :, 1], kv.values[0, :, 5])
    assert not torch.allclose(kv.keys[0, :, 1], kv.keys[0, :, 5], atol=1e-3)
    assert torch.allclose(kv.keys[0, :, 1].norm(dim=-1), kv.keys[0, :, 5].norm(dim=-1), rtol=1e-4)


def test_empty_text_is_rejected(tiny_llama):
    with pytest.raises(InputError, match="empty"):
        extract_kv(tiny_llama, text="   ")


def test_text_longer_than_context_is_rejected(tiny_llama):
    with pytest.raises(InputError, match="exceed"):
        extract_kv(tiny_llama, token_ids=list(range(tiny_llama.max_positions + 1)))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cachegen", *args], capture_output=True, text=True)


def test_extract_cli_writes_a_loadable_kv_directory(tmp_path, tiny_llama):
    text_file = tmp_path / "ctx.txt"
    text_file.write_text(TEXT)
    out = run_cli(
        "extract",
        "--model",
        "tiny-llama",
        "--text-file",
        str(text_file),
        "--out",
        str(tmp_path / "kv"),
        "--json",
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    kv = KVCache.load(tmp_path / "kv", expect_model=tiny_llama.identity())
    assert summary["num_tokens"] == kv.num_tokens
    assert summary["bytes"] == kv.nbytes
    assert (summary["num_layers"], summary["num_kv_heads"], summary["head_dim"]) == (4, 2, 64)
    assert summary["dtype"] == "bfloat16"
    assert summary["windows"] == [None] * 4


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "no-such-model", "--text", "hi"], "unknown model"),
        (["--model", "tiny-llama", "--text", ""], "empty"),
        (["--model", "tiny-llama", "--text", "word " * 3000], "exceed"),
    ],
)
def test_extract_cli_bad_input_exits_nonzero_without_output(
    tmp_path, tiny_llama, capsys, args, message
):
    """In this process (the whole command line runs in a subprocess above): exit status 1, the
    reason on stderr, nothing written."""
    from cachegen.cli import main

    assert main(["extract", *args, "--out", str(tmp_path / "kv")]) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "kv").exists()
