"""A LoRA adapter's KV reaches only requests of that adapter (its weights, not its name), through
``LLM(...)`` and through vLLM's OpenAI server; the server's ``/metrics`` shows the connector's
counters.

SmolLM2-135M in vLLM's CPU build with ``enable_lora`` and the connector in raw mode (exact, so
a load that happens answers exactly as recomputing does), saving inside the engine step
(``save_async: false``: stored when the request returns). The adapters are rank-8 PEFT
directories with random weights on k_proj and v_proj, so they change every layer's keys and
values.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from tests.support import CHUNK, connector_engine

CONTEXT = 2 * CHUNK  # the stored prefix: two chunks
ANSWER = 12
RANK = 8


def write_adapter(path, spec, seed: int):
    """A PEFT LoRA directory for ``spec`` with random bf16 weights on k_proj and v_proj."""
    from safetensors.torch import save_file

    config = spec.config
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv_width = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.05
            tensors[f"{name}.lora_B.weight"] = torch.randn(kv_width, RANK, generator=gen) * 0.05
    path.mkdir(parents=True)
    save_file(
        {k: v.to(torch.bfloat16) for k, v in tensors.items()}, path / "adapter_model.safetensors"
    )
    (path / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "target_modules": ["k_proj", "v_proj"],
                "bias": "none",
                "base_model_name_or_path": str(spec.path),
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def adapters(smollm2, tmp_path_factory) -> dict[str, str]:
    """Two adapters with other weights; both are served under the name "tuned"."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        key: str(write_adapter(root / key, smollm2, seed)) for key, seed in (("a", 1), ("b", 2))
    }


@pytest.fixture(scope="module")
def prompt(smollm2) -> list[int]:
    from cachegen import workload
    from cachegen.extract import load_model

    _, tokenizer, _ = load_model(smollm2)
    ids = tokenizer(workload.text("eval")[:8000])["input_ids"][:CONTEXT]
    return ids + tokenizer("\n\nQuestion: what is this about? Answer:")["input_ids"]


# ---- LLM(...) ----------------------------------------------------------------------------------


@pytest.fixture
def engine(smollm2, tmp_path_factory):
    """An engine for one test: closed before the server's tests start."""
    store = tmp_path_factory.mktemp("adapter-store").as_uri()
    with connector_engine(
        smollm2,
        store,
        save_modes=("raw",),
        connector_extra={"save_async": False},
        enable_lora=True,
        max_lora_rank=RANK,
    ) as eng:
        yield eng


def _generate(engine, prompt, lora=None, **params) -> tuple[list[int], dict, int]:
    from vllm import SamplingParams

    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=ANSWER,
        ignore_eos=True,
        extra_args={"kv_transfer_params": {"mode": "raw", **params}},
    )
    out = engine.llm.generate(
        [{"prompt_token_ids": prompt}], sampling, lora_request=lora, use_tqdm=False
    )[0]
    return list(out.outputs[0].token_ids), out.kv_transfer_params["cachegen"], out.num_cached_tokens


def test_an_adapters_chunks_reach_only_requests_of_its_weights(engine, adapters, prompt):
    from vllm.lora.request import LoRARequest

    tuned_a = LoRARequest("tuned", 1, adapters["a"])
    tuned_b = LoRARequest("tuned", 2, adapters["b"])  # the same name, other weights
    base_recomputed, _, _ = _generate(engine, prompt, load=False, save=False)
    a_stored, report, _ = _generate(engine, prompt, tuned_a)  # computes and stores
    assert report["save_chunks"] == CONTEXT // CHUNK
    assert a_stored != base_recomputed  # the adapter changes the answer

    base, report, cached = _generate(engine, prompt)
    assert cached == 0 and report.get("loaded_tokens", 0) == 0
    assert base == base_recomputed

    a_loaded, report, cached = _generate(engine, prompt, tuned_a, save=False)
    assert cached == CONTEXT and report["loaded_tokens"] == CONTEXT
    assert a_loaded == a_stored and report["salted"] is True  # keyed in the adapter's scope

    b, report, cached = _generate(engine, prompt, tuned_b, save=False)
    assert cached == 0 and report.get("loaded_tokens", 0) == 0


# ---- the OpenAI server and its /metrics --------------------------------------------------------


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _scrape_until(url: str, name: str, want: float, **labels: str) -> str:
    """``/metrics`` once ``name`` reaches ``want``: vLLM records a step's stats beside sending
    its outputs, so a response can come a moment before its counts (at most 60 s of polling)."""
    import httpx

    for _ in range(120):
        text = httpx.get(url, timeout=30).text
        if _metric(text, name, **labels) >= want:
            break
        time.sleep(0.5)
    return text


@pytest.fixture(scope="module")
def server(adapters):
    """vLLM's OpenAI server with adapter "a" served as "tuned" (swappable at run time)."""
    import os

    from cachegen_lab.bench.openai_server import OpenAIServer

    lora_args = ["--enable-lora", "--max-lora-rank", str(RANK)]
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # to swap "tuned"'s weights
    try:
        with OpenAIServer(
            "smollm2-135m",
            mode="raw",
            connector_extra={"save_async": False},
            server_args=[*lora_args, "--lora-modules", f"tuned={adapters['a']}"],
        ) as running:
            yield running
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]


def _complete(server, prompt, model: str) -> dict:
    response = server.client(timeout=600).completions.create(
        model=model, prompt=prompt, max_tokens=ANSWER, temperature=0
    )
    return response.model_extra["kv_transfer_params"]["cachegen"]


def _metrics_url(server) -> str:
    return f"{server.url}/metrics"


def test_the_server_exports_the_connectors_metrics_before_any_request(server):
    import httpx

    text = httpx.get(_metrics_url(server), timeout=30).text
    assert "# TYPE vllm:cachegen_lookups_total counter" in text
    assert "# TYPE vllm:cachegen_load_seconds histogram" in text
    assert _metric(text, "vllm:cachegen_lookups_total") == 0


def test_through_the_server_the_base_model_loads_nothing_of_an_adapters_chunks(server, prompt):
    assert _complete(server, prompt, "tuned")["save_chunks"] == CONTEXT // CHUNK
    assert _complete(server, prompt, server.model).get("loaded_tokens", 0) == 0
    after = _scrape_until(_metrics_url(server), "vllm:cachegen_lookups_total", 2, mode="raw")
    assert _metric(after, "vllm:cachegen_lookups_total", mode="raw") == 2
    assert _metric(after, "vllm:cachegen_hits_total") == 0
    assert _metric(after, "vllm:cachegen_saves_total", mode="raw") == 2  # each stored its own
    assert _metric(after, "vllm:cachegen_saved_bytes_total", mode="raw") > 0


def test_through_the_server_an_adapter_loads_its_own_chunks(server, prompt):
    assert _complete(server, prompt, "tuned")["loaded_tokens"] == CONTEXT
    last = _scrape_until(_metrics_url(server), "vllm:cachegen_hits_total", 1, mode="raw")
    assert _metric(last, "vllm:cachegen_lookups_total", mode="raw") == 3
    assert _metric(last, "vllm:cachegen_hits_total", mode="raw") == 1
    assert _metric(last, "vllm:cachegen_hit_tokens_total", mode="raw") == CONTEXT
    assert _metric(last, "vllm:cachegen_loaded_bytes_total", mode="raw") > 0
    assert _metric(last, "vllm:cachegen_load_seconds_count", mode="raw") == 1
    assert _metric(last, "vllm:cachegen_fallbacks_total") == 0


def test_through_the_server_other_weights_under_the_name_load_nothing(server, adapters, prompt):
    import httpx

    for action, body in (
        ("unload", {"lora_name": "tuned"}),
        ("load", {"lora_name": "tuned", "lora_path": adapters["b"]}),
    ):
        response = httpx.post(f"{server.url}/v1/{action}_lora_adapter", json=body, timeout=120)
        assert response.status_code == 200, response.text
    assert _complete(server, prompt, "tuned").get("loaded_tokens", 0) == 0
