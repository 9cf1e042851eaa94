"""Quality with decoded KV: replay exactness, metrics, datasets, frontier, sweep, calibration, CLI.

Everything runs on the tiny random-weight models with short windows; the SmolLM2 numbers
live in docs/quality.md and come from `cachegen sweep` (see there).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from cachegen import models
from cachegen.errors import InputError
from cachegen.fitting.replay import continuation_logits, greedy_generate
from cachegen.kv import KVCache
from cachegen.profiles import codec_for
from cachegen.workload.retrieval import answer_is_correct, default_lengths, retrieval_windows
from cachegen_lab.quality import frontier
from cachegen_lab.quality.candidates import codec_candidates, parse_codec_args
from cachegen_lab.quality.datasets import (
    DataSettings,
    file_windows,
    load_windows,
    pydoc_windows,
)
from cachegen_lab.quality.evaluate import Candidate, EvalSettings, evaluate
from cachegen_lab.quality.metrics import (
    Reference,
    compare_logits,
    corpus_bleu,
    rouge_l,
    wilson_ci,
)

SMALL = dict(context_tokens=96, continuation_tokens=16)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    from cachegen.extract import load_model

    return load_model(tiny_llama)


@pytest.fixture(scope="module")
def windows(llama):
    _, tokenizer, _ = llama
    return pydoc_windows(tokenizer, count=3, seed=7, **SMALL)


def uniform_quantizer(levels: int) -> Candidate:
    """Test-only round trip: symmetric uniform quantization per (layer, head, token) row."""

    def roundtrip(kv: KVCache) -> tuple[KVCache, float]:
        def q(x: torch.Tensor) -> torch.Tensor:
            x = x.float()
            amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)
            half = (levels - 1) / 2
            return (torch.round(x / amax * half) / half * amax).to(kv.dtype)

        bits = math.log2(levels) * kv.num_elements
        return KVCache(q(kv.keys), q(kv.values), kv.token_ids, kv.model, kv.start), bits

    return Candidate("uniform", str(levels), roundtrip)


# ---- replay ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_opt", "tiny_qwen2"])
def test_replay_with_extracted_kv_equals_recomputing(name, request):
    from cachegen.extract import extract_kv, load_model

    spec = request.getfixturevalue(name)
    hf_model, tokenizer, _ = load_model(spec)
    window = pydoc_windows(tokenizer, count=1, seed=3, **SMALL)[0]
    kv = extract_kv(spec, token_ids=window.context_ids)
    replayed = continuation_logits(hf_model, [kv], window.continuation_ids)
    full = torch.cat([window.context_ids, window.continuation_ids]).unsqueeze(0)
    with torch.inference_mode():
        recomputed = hf_model(input_ids=full).logits[:, window.context_ids.numel() :]
    # One forward over the whole text and one over the continuation alone run matmuls of
    # different shapes; on CPUs without native bf16 their blocking can differ in the last bit,
    # so the two agree to one bf16 step at the logits' scale.
    eps = torch.finfo(torch.bfloat16).eps
    last_bit = {"rtol": eps, "atol": eps * recomputed.float().abs().max().item()}
    torch.testing.assert_close(replayed, recomputed, **last_bit)
    # rows of a batch do not influence each other (beyond the same last-bit blocking effect)
    batched = continuation_logits(hf_model, [kv, kv.to(torch.float32)], window.continuation_ids)
    torch.testing.assert_close(batched[0], replayed[0], **last_bit)
    torch.testing.assert_close(batched[1], replayed[0], **last_bit)


def test_greedy_generation_is_deterministic_and_stops(llama, windows):
    from cachegen.extract import extract_kv

    hf_model, _, spec = llama
    kv = extract_kv(spec, token_ids=windows[0].context_ids)
    prompt = windows[0].continuation_ids[:1]
    first, again = greedy_generate(hf_model, [kv, kv], prompt, 8)
    assert first == again and len(first) == 8
    stopped = greedy_generate(hf_model, [kv], prompt, 8, stop_ids=frozenset({first[3]}))[0]
    assert stopped == first[: first.index(first[3])]


def test_replay_rejects_a_slice_and_a_foreign_geometry(llama, windows, tiny_qwen2):
    from cachegen.extract import extract_kv

    hf_model, _, spec = llama
    kv = extract_kv(spec, token_ids=windows[0].context_ids)
    with pytest.raises(Exception, match="position 0"):
        continuation_logits(hf_model, [kv.slice(4, 20)], windows[0].continuation_ids)
    other = extract_kv(tiny_qwen2, token_ids=windows[0].context_ids)
    with pytest.raises(Exception, match="geometry"):
        continuation_logits(hf_model, [other], windows[0].continuation_ids)


# ---- metrics -----------------------------------------------------------------------------------


def test_wilson_interval_of_accuracy():
    """Known values of the 95% Wilson score interval, and never empty at 0 or all successes."""
    low, high = wilson_ci(20, 20)
    assert high == 1.0 and 0.83 < low < 0.84
    low, high = wilson_ci(0, 20)
    assert low == 0.0 and 0.16 < high < 0.17
    low, high = wilson_ci(45, 100)
    assert 0.35 < low < 0.36 and 0.54 < high < 0.55
    with pytest.raises(ValueError):
        wilson_ci(0, 0)


def test_metrics_on_identical_and_different_distributions():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    targets = torch.tensor([1, 2, 3, 4, 5])
    ref = Reference.of(logits, targets)
    same = compare_logits(ref, logits.clone())
    assert same.kl == 0.0 and same.agree == 5 and same.nll == same.nll_original
    other = compare_logits(ref, logits + torch.randn(5, 11))
    assert other.kl > 0 and other.nll != other.nll_original
    assert rouge_l("a b c", "a b c") == 1.0 and rouge_l("", "") == 1.0
    assert rouge_l("x = f(a, b)", "x = g(a, b)") < 1.0
    assert corpus_bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == 100.0
    assert corpus_bleu(["the cat sat on the mat"], ["a dog lay on a rug"]) < 20.0


def test_raw_codec_is_exact_through_the_whole_evaluation(llama, windows):
    _, _, spec = llama
    candidates = (
        codec_candidates(spec, "raw", None)
        + [uniform_quantizer(7)]
        + codec_candidates(spec, "raw", None)
    )
    settings = EvalSettings(gen_tokens=12)
    rows = evaluate(spec.name, windows, candidates, settings, progress=False)
    for row in (rows[0], rows[2]):
        assert row["ppl_change_pct"] == 0.0
        assert row["ppl_change_ci95"] == [0.0, 0.0]
        assert row["top1_agreement"] == 1.0 and row["kl"] == 0.0
        assert row["exact_match"] == 1.0 and row["rougeL"] == 1.0 and row["bleu"] == 100.0
        assert row["windows"] == 3 and row["tokens_scored"] == 3 * SMALL["continuation_tokens"]
        assert 16.0 < row["bits_per_element"] < 16.5  # bf16 payload plus headers and token ids
    assert rows[1]["kl"] > 0


def test_a_candidates_row_does_not_depend_on_the_other_candidates(smollm2):
    # every run replays its KV alone: in a batch, the rows' logits would depend on the batch's
    # size (oneDNN's bf16 kernels on CPUs with AMX; a real model's 30 layers carry the
    # rounding to the scores), so adding candidates would move a candidate's score
    from cachegen.extract import load_model

    _, tokenizer, _ = load_model(smollm2)
    cut = dict(context_tokens=1024, continuation_tokens=128)  # big enough for the effect
    windows = pydoc_windows(tokenizer, count=1, seed=7, **cut)
    settings = EvalSettings(gen_tokens=4)
    alone = evaluate(smollm2.name, windows, [uniform_quantizer(5)], settings, progress=False)
    others = [uniform_quantizer(3), uniform_quantizer(5), uniform_quantizer(7)]
    beside = evaluate(smollm2.name, windows, others, settings, progress=False)
    assert beside[1] == alone[0]


def test_metrics_move_the_right_way_as_quantization_gets_coarser(llama, windows):
    _, _, spec = llama
    rows = evaluate(
        spec.name,
        windows,
        [uniform_quantizer(n) for n in (255, 31, 7, 3)],
        EvalSettings(gen_tokens=12),
        progress=False,
    )
    kl = [r["kl"] for r in rows]
    agreement = [r["top1_agreement"] for r in rows]
    assert all(a < b for a, b in zip(kl, kl[1:])), kl
    assert all(a >= b for a, b in zip(agreement, agreement[1:])), agreement
    assert agreement[-1] < 0.9 and rows[-1]["rougeL"] < 1.0
    assert [r["bits_per_element"] for r in rows] == sorted(
        (r["bits_per_element"] for r in rows), reverse=True
    )


def test_real_codecs_order_by_fidelity(llama, windows):
    _, _, spec = llama
    candidates = [c for name in ("int8", "kivi2") for c in codec_candidates(spec, name, None)]
    int8, kivi2 = evaluate(
        spec.name, windows, candidates, EvalSettings(gen_windows=0), progress=False
    )
    assert int8["kl"] < kivi2["kl"] and int8["top1_agreement"] >= kivi2["top1_agreement"]
    assert kivi2["bits_per_element"] < int8["bits_per_element"]
    assert int8["generations"] == 0 and int8["rougeL"] is None


# ---- datasets ------------------------------------------------------------------------------------


def test_pydoc_windows_are_seeded_disjoint_and_skip_calibration_text(llama):
    _, tokenizer, _ = llama
    a = pydoc_windows(tokenizer, count=20, seed=1, **SMALL)
    b = pydoc_windows(tokenizer, count=20, seed=1, **SMALL)
    c = pydoc_windows(tokenizer, count=20, seed=2, **SMALL)
    assert [w.source for w in a] == [w.source for w in b] != [w.source for w in c]
    starts = sorted(int(w.source.split("@")[1]) for w in a)
    assert all(y - x >= SMALL["continuation_tokens"] + 1 for x, y in zip(starts, starts[1:]))
    for w in a:
        assert w.context_ids.numel() == SMALL["context_tokens"]
        assert w.continuation_ids.numel() == SMALL["continuation_tokens"] + 1
    with pytest.raises(InputError, match="unknown split"):
        pydoc_windows(tokenizer, count=1, split="tables", **SMALL)


def test_user_text_and_jsonl_files(llama, tmp_path):
    _, tokenizer, _ = llama
    words = " ".join(f"word{i}" for i in range(600))
    text = tmp_path / "notes.txt"
    text.write_text(words)
    assert len(file_windows(text, tokenizer, count=2, **SMALL)) == 2
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": words[i::3]}) for i in range(3)) + "\n")
    assert len(file_windows(docs, tokenizer, count=2, **SMALL)) == 2
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        json.dumps({"context": "The capital of France is", "continuation": " Paris, a city."})
        + "\n"
    )
    (window,) = file_windows(pairs, tokenizer, count=5, **SMALL)
    assert window.continuation_ids.numel() >= 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{oops\n')
    with pytest.raises(InputError, match="bad.jsonl:2"):
        file_windows(bad, tokenizer, count=1, **SMALL)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(InputError, match="--context-tokens"):
        file_windows(short, tokenizer, count=1, **SMALL)
    with pytest.raises(InputError, match="not a file"):
        load_windows(
            DataSettings(dataset=str(tmp_path / "missing.txt"), windows=1), tokenizer, 2048
        )


def test_retrieval_task_is_seeded_and_answerable(llama):
    _, tokenizer, spec = llama
    a = retrieval_windows(
        tokenizer, lengths=[(300, 3), (600, 2)], seed=5, max_positions=spec.max_positions
    )
    b = retrieval_windows(
        tokenizer, lengths=[(300, 3), (600, 2)], seed=5, max_positions=spec.max_positions
    )
    assert len(a) == 5
    assert [w.answer for w in a] == [w.answer for w in b]
    for w in a:
        context = tokenizer.decode(w.context_ids)
        length = w.tags["context_tokens"]
        assert length - 40 < w.context_ids.numel() <= length
        assert context.count(f"<{w.answer}>") == 1
        name = (
            tokenizer.decode(w.continuation_ids[: w.prompt_len]).split("in line ")[1].split("?")[0]
        )
        assert f"line {name}: REGISTER_CONTENT is <{w.answer}>" in context
    assert default_lengths(8192) == [1024, 2048, 4096, 8064]
    assert answer_is_correct("12345>", "12345") and not answer_is_correct("1234>", "12345")
    with pytest.raises(InputError, match="positions"):
        retrieval_windows(tokenizer, lengths=[(4096, 1)], max_positions=2048)


def test_retrieval_rows_report_accuracy(llama):
    _, tokenizer, spec = llama
    windows = retrieval_windows(
        tokenizer, lengths=[(200, 1), (400, 1)], max_positions=spec.max_positions
    )
    (row,) = evaluate(spec.name, windows, codec_candidates(spec, "raw", None), progress=False)
    assert row["retrieval_accuracy"] == row["retrieval_accuracy_original"]
    assert set(row["retrieval_by_length"]) == {"200", "400"}
    assert all(v["samples"] == 1 for v in row["retrieval_by_length"].values())


# ---- frontier, sweep, calibration ----------------------------------------------------------------


def row(codec, level, bits, ppl, agree=0.9, kl=0.01):
    return {
        "codec": codec,
        "level": level,
        "bits_per_element": bits,
        "ppl_change_pct": ppl,
        "top1_agreement": agree,
        "kl": kl,
        "windows": 1,
    }


def test_pareto_frontier_and_dominance(tmp_path):
    rows = [
        row("a", "1", 2.0, 5.0),
        row("a", "2", 3.0, 1.0),
        row("b", "0", 3.5, 2.0),
        row("c", "0", 16.0, 0.0),
        row("d", "0", 2.5, -0.5),
    ]
    assert frontier.pareto(rows) == [0, 4, 3]  # |ppl change| counts: -0.5% beats +1%
    frontier.annotate(rows)
    assert [r["pareto"] for r in rows] == [True, False, False, True, True]
    assert rows[2]["dominated_by"] == ["d/0"]
    table = frontier.markdown_table(rows)
    assert "**d/0**" in table and table.count("\n") == len(rows) + 2
    png = frontier.plot(rows, tmp_path / "rd.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_targets_read_off_rows():
    from cachegen_lab.quality.rd_sweep import check_targets

    rows = [
        row("cachegen", "2", 2.5, 6.6),
        row("kivi2", "0", 3.0, 4.0),
        row("cachegen", "x", 2.4, 1.5),
    ]
    frontier.annotate(rows)
    targets = check_targets(rows)
    assert targets["operating_point_le_2.5_bits_le_2.0_pct"]["level"] == "x"
    assert targets["frontier_dominates"] == {
        "cachegen/2": ["cachegen/x"],
        "kivi2/0": ["cachegen/x"],
    }


def test_calibration_meets_its_targets_and_saves_levels(tiny_llama, isolated_profiles):
    from cachegen_lab.quality.calibrate import CalibrationSettings, calibrate, save_level

    settings = CalibrationSettings(
        targets=(0.5, 2.0),
        windows=2,
        stats_windows=1,
        ladder=(4, 8, 16, 32),
        hadamard=(True,),
        scales=("token", "token-head"),
        probe_groups=2,
        **SMALL,
    )
    result = calibrate(tiny_llama.name, settings, progress=False)
    strict, loose = result.choices
    for choice in result.choices:
        trial = choice.trial
        assert abs(trial.ppl_change_pct) <= choice.target_ppl_pct and trial.kl <= choice.kl_budget
        cheaper = [t for t in result.trials if t.est_bits_per_element < trial.est_bits_per_element]
        assert all(
            t.kl > choice.kl_budget or abs(t.ppl_change_pct) > choice.target_ppl_pct
            for t in cheaper
        )
        assert len(choice.config.key_bins) == 4 and choice.config.hadamard
        assert choice.codec_bits_per_element > 0
    assert loose.trial.est_bits_per_element <= strict.trial.est_bits_per_element
    saved = save_level(tiny_llama.name, strict.config, 7, make_default=True)
    codec = codec_for("cachegen", tiny_llama)
    assert saved["default"] and codec.default_level == 7
    assert codec.profile.config(7).key_bins == strict.config.key_bins
    assert "calibrated" in codec.profile.config(7).description


def test_variant_candidates_leave_the_saved_profile_alone(tiny_llama, isolated_profiles, windows):
    from cachegen_lab.quality.rd_sweep import grid, variants

    before = set(codec_for("cachegen", tiny_llama).levels)
    candidates = grid(tiny_llama)
    names = [f"{c.codec}/{c.level}" for c in candidates]
    assert {
        "raw/0",
        "int8/0",
        "fp8/0",
        "int8-zstd/0",
        "kivi2/0",
        "cachegen/1",
        "cachegen/2",
        "cachegen/3",
    } <= set(names)
    assert {f"cachegen/{v}" for v in variants(tiny_llama)} <= set(names)
    assert {"cachegen/k32-vth6+rope", "cachegen/k32-vth6+rope+sink"} <= set(
        names
    )  # tiny-llama has RoPE
    assert set(codec_for("cachegen", tiny_llama).levels) == before
    variant = next(c for c in candidates if c.level == "had-th-16")
    from cachegen.extract import extract_kv

    decoded, bits = variant.roundtrip(extract_kv(tiny_llama, token_ids=windows[0].context_ids))
    assert decoded.keys.shape[2] == SMALL["context_tokens"] and bits > 0


def test_eval_takes_sweep_variants_by_name(tiny_llama, isolated_profiles):
    from cachegen_lab.quality.candidates import codec_candidates

    (candidate,) = codec_candidates(tiny_llama, "cachegen", ["k32-vth6+rope+sink"])
    assert candidate.options["exact_tokens"] == 1 and candidate.options["rope_theta"] > 0
    with pytest.raises(InputError, match="k32-vth6"):
        codec_candidates(tiny_llama, "cachegen", ["no-such-variant"])
    opt_variants = {
        c.level for c in codec_candidates(models.resolve("tiny-opt"), "cachegen", ["k32-vth6+sink"])
    }
    assert opt_variants == {"k32-vth6+sink"}
    with pytest.raises(InputError):  # OPT has learned positions: nothing to turn back
        codec_candidates(models.resolve("tiny-opt"), "cachegen", ["k32-vth6+rope"])


# ---- CLI -----------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    from cachegen.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


EVAL = [
    "eval",
    "--model",
    "tiny-llama",
    "--windows",
    "2",
    "--context-tokens",
    "96",
    "--continuation-tokens",
    "16",
    "--gen-tokens",
    "8",
    "--no-progress",
]


def test_cli_eval_json_rows(capsys, tmp_path):
    code, out, err = run_cli(
        capsys, *EVAL, "--codec", "raw", "--codec", "kivi2", "--json", "--out", str(tmp_path)
    )
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["codec"], r["level"]) for r in rows] == [("raw", "0"), ("kivi2", "0")]
    for r in rows:
        for field in (
            "codec",
            "level",
            "bits_per_element",
            "ppl_change_pct",
            "top1_agreement",
            "kl",
            "rougeL",
            "bleu",
            "windows",
        ):
            assert field in r
    assert (
        rows[0]["ppl_change_pct"] == 0.0
        and rows[0]["top1_agreement"] == 1.0
        and rows[0]["rougeL"] == 1.0
    )
    document = json.loads((tmp_path / "eval.json").read_text())
    assert (document["schema"], document["version"]) == ("cachegen-quality-results", 1)
    assert document["command"].startswith(
        "cachegen eval --model tiny-llama --dataset pydoc --windows 2"
    )
    assert (tmp_path / "eval.png").stat().st_size > 0 and "raw/0" in (
        tmp_path / "eval.md"
    ).read_text()


def test_cli_sweep_replot_redraws_from_json(capsys, tmp_path):
    code, _, err = run_cli(
        capsys, *EVAL, "--codec", "raw", "--codec", "int8", "--out", str(tmp_path)
    )
    assert code == 0, err
    (tmp_path / "eval.json").rename(tmp_path / "sweep.json")
    code, out, err = run_cli(capsys, "sweep", "--out", str(tmp_path), "--replot")
    assert code == 0, err
    assert (
        "int8/0" in (tmp_path / "sweep.md").read_text()
        and (tmp_path / "sweep.png").stat().st_size > 0
    )
    # re-evaluated rows replace theirs, new ones are added, dropped ones go; other windows are
    # refused
    update = tmp_path / "update"
    code, _, err = run_cli(capsys, *EVAL, "--codec", "int8", "--codec", "fp8", "--out", str(update))
    assert code == 0, err
    code, out, err = run_cli(
        capsys,
        "sweep",
        "--out",
        str(tmp_path),
        "--replot",
        "--update",
        str(update / "eval.json"),
        "--drop",
        "raw/0",
    )
    assert code == 0, err
    merged = json.loads((tmp_path / "sweep.json").read_text())
    assert [f"{r['codec']}/{r['level']}" for r in merged["rows"]] == ["int8/0", "fp8/0"]
    assert merged["updates"][0]["command"].startswith("cachegen eval") and merged["updates"][1] == {
        "dropped": ["raw/0"]
    }
    other = tmp_path / "other"
    code, _, err = run_cli(
        capsys, *EVAL[:-1], "--seed", "5", "--no-progress", "--codec", "fp8", "--out", str(other)
    )
    assert code == 0, err
    code, out, err = run_cli(
        capsys, "sweep", "--out", str(tmp_path), "--replot", "--update", str(other / "eval.json")
    )
    assert code == 1 and "other data" in err
    code, out, err = run_cli(capsys, "sweep", "--out", str(tmp_path), "--drop", "fp8/0")
    assert code == 1 and "--replot" in err
    (tmp_path / "sweep.json").write_text(
        '{"schema": "cachegen-quality-results", "version": 1, "rows": "not a list"}'
    )
    code, out, err = run_cli(capsys, "sweep", "--out", str(tmp_path), "--replot")
    assert code == 1 and "not a whole results file" in err and len(err.strip().splitlines()) == 1


def test_cli_eval_table_and_retrieval(capsys):
    code, out, err = run_cli(
        capsys,
        "eval",
        "--model",
        "tiny-llama",
        "--dataset",
        "retrieval",
        "--windows",
        "1",
        "--retrieval-lengths",
        "200,300:1",
        "--codec",
        "raw",
        "--no-progress",
        "--json",
    )
    assert code == 0, err
    (r,) = json.loads(out)
    assert r["retrieval_accuracy"] == r["retrieval_accuracy_original"]
    assert {k: v["samples"] for k, v in r["retrieval_by_length"].items()} == {"200": 1, "300": 1}
    code, out, err = run_cli(capsys, *EVAL, "--codec", "cachegen:3")
    assert code == 0, err
    assert (
        out.splitlines()[0].split()[:3] == ["codec/level", "bits/elem", "ppl"]
        and "cachegen/3" in out
    )


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--codec", "nonesuch"], "unknown codec"),
        (["--codec", "cachegen:9"], "no level 9"),
        (["--codec", "raw", "--dataset", "/nonexistent/file.txt"], "not a file"),
        (["--codec", "raw", "--windows", "0"], "--windows"),
    ],
)
def test_cli_eval_errors_are_one_line(capsys, extra, message):
    code, out, err = run_cli(capsys, *EVAL, *extra)
    assert code == 1 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_parse_codec_args():
    assert parse_codec_args(["raw", "cachegen:1,2"], "all") == [
        ("raw", None),
        ("cachegen", ["1", "2"]),
    ]
    assert parse_codec_args(["cachegen"], "3") == [("cachegen", ["3"])]
    with pytest.raises(InputError):
        parse_codec_args([":1"], None)


def test_seeded_bootstrap_interval_brackets_the_estimate(llama, windows):
    _, _, spec = llama
    (r,) = evaluate(
        spec.name, windows, [uniform_quantizer(5)], EvalSettings(gen_windows=0), progress=False
    )
    low, high = r["ppl_change_ci95"]
    assert low <= r["ppl_change_pct"] <= high
    random.seed(0)  # the interval does not depend on the global RNG
    (again,) = evaluate(
        spec.name, windows, [uniform_quantizer(5)], EvalSettings(gen_windows=0), progress=False
    )
    assert again["ppl_change_ci95"] == r["ppl_change_ci95"]


def test_cli_calibrate_then_apply(capsys, tmp_path, tiny_llama, isolated_profiles):
    code, out, err = run_cli(
        capsys,
        "calibrate",
        "--model",
        "tiny-llama",
        "--windows",
        "1",
        "--context-tokens",
        "96",
        "--continuation-tokens",
        "16",
        "--probe-groups",
        "1",
        "--target-ppl",
        "5,10",
        "--dry-run",
        "--no-progress",
        "--json",
        "--out",
        str(tmp_path),
    )
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["schema"], summary["version"]) == ("cachegen-calibration", 1)
    assert [c["target_ppl_pct"] for c in summary["choices"]] == [5.0, 10.0]
    assert all("saved" not in c for c in summary["choices"])
    assert 9 not in codec_for("cachegen", tiny_llama).levels
    code, out, err = run_cli(
        capsys,
        "calibrate",
        "--model",
        "tiny-llama",
        "--apply",
        str(tmp_path / "calibration.json"),
        "--level",
        "9",
        "--set-default",
    )
    assert code == 0, err
    assert "saved level 9" in out and "saved level 10" in out
    codec = codec_for("cachegen", tiny_llama)
    assert codec.default_level == 9
    assert list(codec.profile.config(9).key_bins) == summary["choices"][0]["config"]["key_bins"]
    code, out, err = run_cli(
        capsys, "calibrate", "--model", "tiny-opt", "--apply", str(tmp_path / "calibration.json")
    )
    assert code == 1 and "not for 'tiny-opt'" in err


def test_cli_eval_passkey_reports_original_and_codec_accuracy(capsys, gemma3):
    code, out, err = run_cli(
        capsys,
        "eval",
        "--model",
        "gemma3-270m",
        "--dataset",
        "passkey",
        "--retrieval-lengths",
        "600:2",
        "--codec",
        "raw",
        "--codec",
        "int8",
        "--no-progress",
        "--json",
    )
    assert code == 0, err
    rows = json.loads(out)
    assert [r["codec"] for r in rows] == ["raw", "int8"]
    for r in rows:
        assert r["retrieval_accuracy_original"] == 1.0  # Gemma finds both keys in its own KV
        assert r["retrieval_by_length"]["600"]["samples"] == 2
    assert rows[0]["retrieval_accuracy"] == 1.0  # raw is lossless
    assert rows[0]["retrieval_accuracy_ci95"][1] == 1.0
