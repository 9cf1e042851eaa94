"""The layered-stream lab: its entropies, its dead-zone base and its curve's ends are what
they claim, and its command writes a document or refuses with a reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cachegen.cli import main
from cachegen.codec.tcq.code import level_code
from cachegen.fitting.tcq import ensure_tcq_model
from cachegen_lab.experiments import tcq_layers as lab


@pytest.fixture(scope="module")
def model(tiny_llama, profiles):
    return ensure_tcq_model(tiny_llama)


def test_entropy_of_known_rows():
    rng = np.random.default_rng(0)
    rows = np.stack(
        [rng.integers(0, 4, 40_000), np.zeros(40_000, np.int64), rng.integers(0, 2, 40_000)]
    )
    bits = lab.entropy_bits(rows) / rows.shape[1]
    assert bits == pytest.approx([2.0, 0.0, 1.0], abs=0.01)
    assert lab.entropy_bits(rows[:, :0]).tolist() == [0.0, 0.0, 0.0]


def test_the_base_merges_the_top_levels_cells_into_a_dead_zone():
    q = np.array([-5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5])
    coarse, decoded = lab.dead_zone(q)
    assert coarse.tolist() == [-2, -2, -1, -1, 0, 0, 0, 1, 1, 2, 2]
    assert decoded.tolist() == [-4.5, -4.5, -2.5, -2.5, 0, 0, 0, 2.5, 2.5, 4.5, 4.5]
    # every top cell lies in one base cell, which decodes inside the cells it merges
    assert np.all(np.abs(decoded - q) <= 1.0)


def test_the_triple_step_base_is_a_uniform_grid_of_three_top_cells():
    q = np.arange(-8, 9)
    coarse, decoded = lab.triple_step(q)
    assert coarse.tolist() == [-3, -2, -2, -2, -1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert np.array_equal(decoded, 3 * coarse)
    # every base cell holds three top cells and decodes at the middle one
    assert np.all(np.abs(decoded - q) <= 1) and np.all(np.bincount(coarse[1:-1] + 2) == 3)


@pytest.mark.parametrize("base", sorted(lab.BASES))
def test_the_embedded_curve_runs_from_its_base_to_the_top_level(tiny_llama, model, base):
    from cachegen.extract import extract_kv
    from cachegen_lab.experiments.tcq_redundancy import stream_rows

    levels = sorted(model.levels)
    top = levels[-2]
    frames, sums = lab.FrameMeasure(model, levels, top, base), lab.Sums()
    kv = extract_kv(tiny_llama, text="The quick brown fox jumps over the lazy dog. " * 12)
    for chunk in kv.chunks(32):
        frames.measure(stream_rows(model, chunk), sums, [levels[0], top])
    bits, error = lab.embedded_curve(sums, 1)
    side = sums.kept_top  # one bit per kept component and frame names its layer
    assert bits[-1] == pytest.approx(sums.dedicated[top][0] + side)
    assert error[-1] == pytest.approx(sums.dedicated[top][1])
    assert bits[0] < bits[-1] and error[0] > error[-1]
    assert np.all(np.diff(bits) >= 0)
    # a prefix that decodes to the top level exactly costs its joint entropy with the coarser
    assert sums.exact[levels[0]] == pytest.approx(sums.dedicated[levels[0]][0])
    assert sums.exact[top] >= sums.dedicated[top][0]


def test_the_command_writes_its_document(tiny_llama, model, tmp_path):
    out = tmp_path / "layers.json"
    levels = sorted(model.levels)
    argv = ["experiment", "tcq-layers", "--model", tiny_llama.name, "--windows", "1"]
    argv += ["--context-tokens", "64", "--dataset", "pydoc", "--no-progress", "--json", str(out)]
    argv += ["--top-level", str(levels[-1]), "--ladder", f"{levels[0]},{levels[-1]}"]
    assert main([*argv, "--base", "triple-step"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == lab.SCHEMA and doc["version"] == lab.VERSION
    assert doc["base"] == "triple-step"
    (row,) = doc["rows"]
    assert [r["level"] for r in row["levels"]] == levels
    assert row["embedded"]["top"]["distortion"] == pytest.approx(row["levels"][-1]["distortion"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top-level", "99"], "tcq levels are"),
        (["--ladder", "x"], "--ladder must be comma-separated"),
        (["--ladder", "20,21"], "--ladder must list rising levels"),
    ],
)
def test_bad_arguments_exit_2_with_a_reason(tiny_llama, model, capsys, argv, message):
    argv = ["experiment", "tcq-layers", "--model", tiny_llama.name, "--windows", "1", *argv]
    assert main([*argv, "--context-tokens", "64", "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_the_simulation_decodes_what_the_codec_decodes(tiny_llama, model):
    """A dedicated level as the lab decodes it is the codec's own decode (without refined
    sink rows, which the lab leaves out for every candidate)."""
    from cachegen.codec import decode
    from cachegen.codec.tcq.codec import TcqCodec
    from cachegen.extract import extract_kv
    from cachegen_lab.experiments import tcq_layers_quality as quality

    kv = extract_kv(tiny_llama, text="The quick brown fox jumps over the lazy dog. " * 12)
    level = sorted(model.levels)[2]
    simulation = quality.Simulation(model, sorted(model.levels)[-2])
    ours, bits = simulation.dedicated(kv, level)
    codec = TcqCodec(tiny_llama, chunk_tokens=lab.FRAME_TOKENS, tcq=model, refine=False)
    theirs = decode(codec.encode(kv, level))
    for a, b in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
        scale = b.float().abs().max()
        assert torch.allclose(a.float(), b.float(), atol=0.02 * scale), level
    assert 0 < bits < 16 * kv.num_elements


@pytest.mark.parametrize("layout", sorted(lab.BASES))
def test_the_whole_embedded_stream_is_the_top_level(tiny_llama, model, layout):
    from cachegen.extract import extract_kv
    from cachegen_lab.experiments import tcq_layers_quality as quality

    kv = extract_kv(tiny_llama, text="The quick brown fox jumps over the lazy dog. " * 12)
    top = sorted(model.levels)[-2]
    simulation = quality.Simulation(model, top, layout)
    level_kv, level_bits = simulation.dedicated(kv, top)
    whole, whole_bits = simulation.embedded(kv, None, 2)
    assert torch.equal(whole.keys, level_kv.keys) and torch.equal(whole.values, level_kv.values)
    kept = sum(len(c) for per in level_code(model, top).kept for c in per)
    frames = len(kv.chunks(lab.FRAME_TOKENS))
    assert whole_bits == pytest.approx(level_bits + 2 * kept * frames)
    base, base_bits = simulation.embedded(kv, float("inf"), 2)
    assert base_bits < whole_bits
    assert not torch.equal(base.keys, whole.keys)


@pytest.mark.parametrize("layout", sorted(lab.BASES))
def test_refining_a_kind_of_cell_lies_between_base_and_top(tiny_llama, model, layout):
    from cachegen.extract import extract_kv
    from cachegen_lab.experiments import tcq_layers_quality as quality

    kv = extract_kv(tiny_llama, text="The quick brown fox jumps over the lazy dog. " * 12)
    simulation = quality.Simulation(model, sorted(model.levels)[-2], layout)
    base, base_bits = simulation.cells_refined(kv, "none")
    assert torch.equal(base.keys, simulation.embedded(kv, float("inf"), 0)[0].keys)
    top, top_bits = simulation.embedded(kv, None, 0)
    for cells in ("zero", "outer"):
        prefix, bits = simulation.cells_refined(kv, cells)
        assert base_bits <= bits <= top_bits + 1e-6, cells
        error = (prefix.values.float() - top.values.float()).abs().sum()
        assert error < (base.values.float() - top.values.float()).abs().sum()
