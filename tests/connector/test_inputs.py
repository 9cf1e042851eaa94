"""Keys that name everything that makes a request's KV besides its tokens: LoRA adapters by the
content of their files, multimodal items by identifier and position; ``prompt_embeds``
requests refused. Through the connector's scheduler side with synthetic vLLM ``Request``s (no
multimodal model runs offline here), on a store holding one text's chunks; the metrics the
scheduler counts for them. LoRA through a real engine: test_adapters.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from cachegen.connector.config import ConnectorConfig
from cachegen.connector.inputs import InputsRefused, adapter_fingerprint, request_inputs
from cachegen.connector.scheduler import SchedulerSide
from cachegen.connector.transport import ChunkTransport
from cachegen.store.keys import chunk_keys, key_scope
from tests.support import CHUNK

BLOCK = 128
TOKENS = 2 * CHUNK + 1  # two whole chunks to find, and the token vLLM computes


def _adapter(path, seed: int):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    weights = torch.randn(64, generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_an_adapter_is_named_by_its_files_not_its_name(tmp_path):
    a = adapter_fingerprint(str(_adapter(tmp_path / "a", 1)), "tuned")
    same_files = adapter_fingerprint(str(_adapter(tmp_path / "copy", 1)), "other-name")
    other_weights = adapter_fingerprint(str(_adapter(tmp_path / "b", 2)), "tuned")
    assert a == same_files and a != other_weights
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"retrained")
    assert adapter_fingerprint(str(tmp_path / "a"), "tuned") != a  # a changed file is re-read
    with pytest.raises(InputsRefused, match="no files at") as refused:
        adapter_fingerprint(str(tmp_path / "missing"), "tuned")
    assert refused.value.reason == "adapter_unreadable"


def test_an_adapter_file_replaced_while_it_is_read_is_refused_not_raised(tmp_path, monkeypatch):
    """A file listed and then gone (an adapter swapped under the server) refuses the adapter's
    requests the connector's way (neither loaded nor saved), never with an exception."""
    path = _adapter(tmp_path / "swapped", 1)
    real_stat = Path.stat
    seen = []

    def vanished(self, *args, **kwargs):
        if self.name == "adapter_model.safetensors":
            seen.append(self)
            if len(seen) > 1:  # listed as a file, then gone
                raise FileNotFoundError(2, "No such file or directory", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", vanished)
    with pytest.raises(InputsRefused, match="files that cannot be read") as refused:
        adapter_fingerprint(str(path), "tuned")
    assert refused.value.reason == "adapter_unreadable"


def test_scopes_with_inputs_never_meet_scopes_without(tiny_llama):
    ids = list(range(3, 3 + CHUNK))
    model = tiny_llama.identity()
    scopes = [
        None,
        key_scope("t", None),
        key_scope(None, None, {"lora": "ab" * 32}),
        key_scope("t", None, {"lora": "ab" * 32}),
        key_scope(None, None, {"mm": [["image", "img-1", 10, 20]]}),
        key_scope(None, None, {"mm": [["image", "img-1", 11, 20]]}),
    ]
    weights = tiny_llama.served_weights()
    keys = [chunk_keys(model, "p", ids, CHUNK, weights=weights, salt=scope)[0] for scope in scopes]
    assert len(set(keys)) == len(keys)
    assert key_scope("t", "s", None) == key_scope("t", "s") == json.dumps(["t", "s"])  # as before


def _request(ids, req_id="r", **fields):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"mode": "raw"}})
    return Request(req_id, ids, params, None, **fields)


def _image(identifier: str, offset: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=identifier,
        mm_position=PlaceholderRange(offset=offset, length=64),
    )


@pytest.fixture
def scheduler(tiny_llama, tmp_path):
    """The scheduler side on a store holding the chunks of one request with image ``img-a`` at
    token 32 (saved under that request's scope), and of the same tokens as plain text."""
    from cachegen.extract import extract_kv

    config = ConnectorConfig.from_extra_config(
        {"store": (tmp_path / "store").as_uri(), "chunk_tokens": CHUNK, "mode": "raw"}
    )
    transport = ChunkTransport(config, tiny_llama, tiny_llama.identity())
    ids = list(range(3, 3 + TOKENS))
    kv = extract_kv(tiny_llama, token_ids=torch.tensor(ids[: 2 * CHUNK]))
    with_image = key_scope(None, None, request_inputs(_request(ids, mm_features=[_image("a", 32)])))
    transport.save(ids[: 2 * CHUNK], kv, ["raw"], salt=with_image)
    transport.save(ids[: 2 * CHUNK], kv, ["raw"])
    side = SchedulerSide(config, transport.index, BLOCK, "kv_both")
    yield side, ids
    transport.close()


def _matched(side: SchedulerSide, request) -> int:
    """The tokens matched, asked as vLLM asks: again on each step until the store answered."""
    for _ in range(1000):
        matched, _ = side.num_new_matched_tokens(request, 0)
        if matched is not None:
            return matched
        time.sleep(0.01)
    raise AssertionError("the lookup never answered")


def test_a_multimodal_request_loads_only_its_own_items_chunks(scheduler):
    side, ids = scheduler
    assert _matched(side, _request(ids, "same", mm_features=[_image("a", 32)])) == 2 * CHUNK
    assert _matched(side, _request(ids, "other-image", mm_features=[_image("b", 32)])) == 0
    assert _matched(side, _request(ids, "moved", mm_features=[_image("a", 40)])) == 0
    assert _matched(side, _request(ids, "text")) == 2 * CHUNK  # the text's own chunks


def test_a_prompt_embeds_request_is_neither_loaded_nor_saved_and_says_why(scheduler):
    side, ids = scheduler
    request = _request(ids, "embeds", prompt_embeds=torch.zeros(len(ids), 8))
    assert _matched(side, request) == 0
    _, params = side.request_finished(request)
    assert "prompt_embeds" in params["cachegen"]["error"]
    assert side.stats.take().data["fallbacks"] == {"prompt_embeds": 1}


def test_the_scheduler_counts_lookups_and_fallbacks(scheduler):
    side, ids = scheduler
    for req_id, fields in (("text", {}), ("other-image", {"mm_features": [_image("b", 32)]})):
        request = _request(ids, req_id, **fields)
        _matched(side, request)
        side.request_finished(request)
    stats = side.stats.take()
    assert stats.data == {"lookups": {"raw": 2}}  # no load ran: nothing loaded, no fallback
    assert stats.reduce() == {"lookups": 2}
    assert side.stats.take() is None  # each interval is taken once
