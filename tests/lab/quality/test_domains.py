"""Windows from the workload's held-out evaluation domains through the lab."""

from __future__ import annotations

import pytest

from cachegen.errors import InputError
from cachegen_lab.quality.datasets import DataSettings, load_windows


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from cachegen.extract import load_model

    return load_model(tiny_llama)[1]


@pytest.mark.parametrize("domain", ["prose", "code", "dialogue", "legal", "science"])
def test_domain_windows(domain, tokenizer):
    settings = DataSettings(dataset=domain, windows=2, context_tokens=256, continuation_tokens=32)
    windows = load_windows(settings, tokenizer, 8192)
    assert len(windows) == 2
    for window in windows:
        assert window.source.startswith(f"{domain}@")
        assert window.context_ids.numel() == 256
        assert window.continuation_ids.numel() == 33
    again = load_windows(settings, tokenizer, 8192)
    assert [w.source for w in again] == [w.source for w in windows]
    assert settings.describe() == {
        "dataset": domain,
        "seed": 0,
        "context_tokens": 256,
        "continuation_tokens": 32,
    }


def test_only_pydoc_has_a_calibrate_split(tokenizer):
    settings = DataSettings(dataset="prose", windows=1, split="calibrate")
    with pytest.raises(InputError, match="only for dataset 'pydoc'"):
        load_windows(settings, tokenizer, 8192)


def test_unknown_dataset_lists_the_domains(tokenizer, tmp_path):
    listed = "pydoc, prose, code, dialogue, legal, science, retrieval, passkey"
    with pytest.raises(InputError, match=listed):
        load_windows(DataSettings(dataset=str(tmp_path / "news"), windows=1), tokenizer, 8192)
