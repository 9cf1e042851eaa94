"""The workload: named splits of the text that calibration and evaluation never share."""

from __future__ import annotations

import pytest

from cachegen import workload
from cachegen.errors import InputError

# What a contamination check counts as shared text: any run of this many tokens.
SHARED_TOKENS = 13


def _ngrams(ids: list[int], n: int) -> set[tuple[int, ...]]:
    return {tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)}


def test_splits_partition_the_topics():
    names = {split: set(workload.topics(split)) for split in workload.SPLITS}
    assert all(names.values())
    assert not names["tables"] & names["calibrate"]
    assert not names["eval"] & (names["tables"] | names["calibrate"])
    from pydoc_data.topics import topics

    assert set().union(*names.values()) == set(topics)
    with pytest.raises(InputError, match="unknown split"):
        workload.topics("train")


def test_calibration_and_evaluation_share_no_token_ngram(smollm2):
    """Zero token n-gram overlap between each calibration split and the evaluation split,
    with the embedded model's tokenizer (the documentation repeats passages across topics,
    so a split by topic alone would share thousands)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.path)
    ids = {split: tokenizer(workload.text(split))["input_ids"] for split in workload.SPLITS}
    assert len(ids["eval"]) > 30_000  # room for the bench's contexts (5,632 tokens by default)
    grams = {split: _ngrams(ids[split], SHARED_TOKENS) for split in workload.SPLITS}
    assert not grams["tables"] & grams["eval"]
    assert not grams["calibrate"] & grams["eval"]
    assert not grams["tables"] & grams["calibrate"]


def test_eval_drops_paragraphs_that_repeat_calibration_text():
    """The filter is what makes the splits disjoint: topics alone share whole passages."""
    from pydoc_data.topics import topics

    raw = "\n\n".join(topics[name].strip() for name in workload.topics("eval"))
    calibration = workload.text("tables") + "\n\n" + workload.text("calibrate")
    assert workload._runs(raw) & workload._runs(calibration)
    assert not workload._runs(workload.text("eval")) & workload._runs(calibration)
    assert len(workload.text("eval")) > 0.4 * len(raw)  # most of it survives


def test_texts_are_the_same_on_every_call():
    assert workload.text("eval") == workload.text("eval")
    assert workload.bench_question(0) != workload.bench_question(1)


def test_evaluation_domains_share_no_token_ngram_with_calibration_text(smollm2):
    """Every evaluation domain is held out from the calibration text: zero token 13-grams
    shared with the `tables` split and with the `calibrate` split, with the embedded model's
    tokenizer, and enough text left for long windows."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.path)
    calibration = {
        split: _ngrams(tokenizer(workload.text(split))["input_ids"], SHARED_TOKENS)
        for split in ("tables", "calibrate")
    }
    assert workload.domain_text("pydoc") == workload.text("eval")
    for domain in workload.DOMAINS:
        ids = tokenizer(workload.domain_text(domain))["input_ids"]
        assert len(ids) >= 30_000, domain
        grams = _ngrams(ids, SHARED_TOKENS)
        assert not grams & calibration["tables"], domain
        assert not grams & calibration["calibrate"], domain


def test_evaluation_domains_are_distinct_and_stable():
    texts = {domain: workload.domain_text(domain) for domain in workload.DOMAINS}
    assert len(set(texts.values())) == len(workload.DOMAINS)
    workload.domain_text.cache_clear()  # read and filter again, not the cached copy
    assert {domain: workload.domain_text(domain) for domain in workload.DOMAINS} == texts
    calibration = workload.text("tables") + "\n\n" + workload.text("calibrate")
    for domain in workload.DOMAINS:
        assert not workload._runs(texts[domain]) & workload._runs(calibration), domain
    assert "def " in texts["code"] and "Gutenberg" not in texts["prose"]
    assert "GNU GENERAL PUBLIC LICENSE" in texts["legal"]
    assert "Refrangibility" in texts["science"] and "pgdp" not in texts["science"]


def test_unknown_domain_is_refused():
    with pytest.raises(
        InputError, match="unknown domain 'news'.*prose, code, dialogue, legal, science"
    ):
        workload.domain_text("news")


def test_passkey_windows_hide_a_key_at_each_depth(gemma3):
    from cachegen.extract import load_model
    from cachegen.workload.passkey import DEPTHS, passkey_windows

    _, tokenizer, _ = load_model(gemma3)
    windows = passkey_windows(tokenizer, lengths=[512, 1024], samples=5, seed=1)
    assert [w.tags["depth"] for w in windows[:5]] == list(DEPTHS)
    for w in windows:
        assert w.context_ids.numel() == w.tags["context_tokens"]
        assert w.context_ids[0].item() == tokenizer.bos_token_id
        needle = tokenizer(f" {w.answer}.", add_special_tokens=False)["input_ids"]
        context = w.context_ids.tolist()
        assert any(context[i : i + len(needle)] == needle for i in range(len(context)))
        assert tokenizer.decode(w.continuation_ids[w.prompt_len :]).strip() == w.answer
    again = passkey_windows(tokenizer, lengths=[512, 1024], samples=5, seed=1)
    assert [w.answer for w in again] == [w.answer for w in windows]
    with pytest.raises(InputError, match="positions"):
        passkey_windows(tokenizer, lengths=[4096], samples=1, max_positions=2048)


def test_gemma3_finds_the_pass_key_with_its_own_kv(gemma3):
    """The task is answerable: a codec's loss shows as an accuracy drop, not noise."""
    import torch

    from cachegen.extract import load_model
    from cachegen.workload.passkey import ANSWER_TOKENS, passkey_windows
    from cachegen.workload.retrieval import answer_is_correct

    model, tokenizer, _ = load_model(gemma3)
    for w in passkey_windows(tokenizer, lengths=[600], samples=2, seed=2):
        prompt = torch.cat([w.context_ids, w.continuation_ids[: w.prompt_len]]).unsqueeze(0)
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=ANSWER_TOKENS, do_sample=False)
        assert answer_is_correct(tokenizer.decode(out[0, prompt.shape[1] :]), w.answer)
