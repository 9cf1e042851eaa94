"""``cachegen eval-table``: eval documents of several datasets side by side, and the bits of
one codec against each other's."""

from __future__ import annotations

import json
import math

from tests.lab.quality.test_quality import EVAL, run_cli


def _evaluate(capsys, tmp_path, dataset: str):
    out = tmp_path / dataset
    code, _, err = run_cli(
        capsys, *EVAL, "--dataset", dataset, "--codec", "int8", "--codec", "fp8", "--out", str(out)
    )
    assert code == 0, err
    return out / "eval.json"


def test_the_table_holds_every_eval_row_and_compares_bits(capsys, tmp_path):
    paths = [_evaluate(capsys, tmp_path, dataset) for dataset in ("prose", "code")]
    code, out, err = run_cli(capsys, "eval-table", *map(str, paths), "--versus", "fp8", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["schema"] == "cachegen-eval-table" and doc["version"] == 1
    rows = [row for path in paths for row in json.loads(path.read_text())["rows"]]
    cells = {(c["dataset"], c["codec"]): c for c in doc["cells"]}
    assert len(cells) == len(rows) == 4
    for row in rows:
        cell = cells[(row["dataset"], f"{row['codec']}/{row['level']}")]
        assert cell["bits"] == row["bits_per_element"] and cell["top1"] == row["top1_agreement"]
    [versus] = doc["comparisons"]
    by = {(r["dataset"], r["codec"]): r for r in rows}
    ratios = [by[(d, "fp8")]["bits_per_element"] / by[(d, "int8")]["bits_per_element"]
              for d in ("prose", "code")]  # fmt: skip
    assert versus["other"] == "int8" and versus["datasets"] == 2
    assert math.isclose(versus["bits_ratio"], math.sqrt(ratios[0] * ratios[1]))
    code, out, _ = run_cli(capsys, "eval-table", *map(str, paths))  # Markdown
    # a row per dataset, and no comparison row: neither codec is the default --versus's
    assert code == 0 and out.count("| tiny-llama |") == 2


def test_one_result_given_twice_is_refused(capsys, tmp_path):
    path = _evaluate(capsys, tmp_path, "prose")
    code, _, err = run_cli(capsys, "eval-table", str(path), str(path))
    assert code != 0 and "in two eval documents" in err
