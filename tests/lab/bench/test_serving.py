"""cachegen serve-bench's bookkeeping: which answers count as equal to recompute, and the
tables (the servers themselves are exercised by tests/connector/test_openai.py)."""

import pytest

from cachegen.errors import InputError
from cachegen_lab.bench import serving


def _run(mode: str, texts: list[str]) -> dict:
    rows = [
        {"client": 0, "document": 0, "question": q, "text": t, "error": None, "ttft_s": 0.5}
        for q, t in enumerate(texts)
    ]
    return {
        "mode": mode,
        "clients": 1,
        "requests_per_client": len(rows),
        "documents": 1,
        "requests": len(rows),
        "errors": 0,
        "wall_s": 1.0,
        "ttft_p50_s": 0.5,
        "ttft_p95_s": 0.5,
        "requests_per_s": 1.0,
        "output_tokens_per_s": 1.0,
        "output_tokens": 1,
        "answers_equal_recompute": None,
        "rows": rows,
    }


def test_later_recompute_runs_and_other_modes_are_compared_with_the_first_recompute_run():
    runs = [
        _run("recompute", ["a", "b", "c"]),
        _run("recompute", ["a", "x", "c"]),
        _run("raw", ["a", "b", "y"]),
    ]
    runs[2]["rows"][0]["error"] = "timeout"  # an answer that failed never counts as equal
    serving._compare_answers(runs)
    assert [r["answers_equal_recompute"] for r in runs] == [None, 2, 1]
    table = serving.markdown(
        {"model": "m", "context_tokens": 8, "max_tokens": 2, "pair": [], "concurrency": runs}
    )
    recompute_rows = [line for line in table.splitlines() if line.startswith("| recompute")]
    assert "(the reference)" in recompute_rows[0] and "2 of 3" in recompute_rows[1]


def test_bad_counts_fail_before_any_server_starts():
    with pytest.raises(InputError, match="recompute-runs"):
        serving.serve_bench(recompute_runs=0)
    with pytest.raises(InputError, match="not measured here"):
        serving.serve_bench(modes=["int8"])
