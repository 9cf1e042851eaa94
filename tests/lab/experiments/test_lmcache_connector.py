"""``cachegen experiment lmcache-connector``: what it reads from LMCache's log and how it
reports. (The experiment itself runs a vLLM engine with LMCache's connector: docs/benchmarks.md
holds its output on vLLM's CPU build.)"""

from __future__ import annotations

from cachegen_lab.experiments.lmcache_connector import counting_prompt, exceptions_in, markdown

# as LMCache 0.5.6 logs a failed start on vLLM's CPU build (its traceback, then it goes on)
LOG = """[2026-12-07 18:49:58,089] LMCache ERROR: Failed to initialize LMCacheManager components: \
Traceback (most recent call last):
  File "lmcache/v1/gpu_connector/__init__.py", line 247, in CreateGPUConnector
    raise RuntimeError(f"No supported {torch_device_type} connector found.")
RuntimeError: No supported cpu connector found.
. System will operate in degraded mode (recompute).
[2026-12-07 18:50:04,138] LMCache INFO: Reqid: 0-b979e2f2, Total tokens 3389, LMCache hit tokens: 0
"""


def test_the_exception_lines_of_lmcaches_log_are_found():
    assert exceptions_in(LOG) == ["RuntimeError: No supported cpu connector found."]
    assert exceptions_in("LMCache INFO: Stored 256 tokens\n") == []


def test_the_report_names_versions_tokens_loaded_and_what_lmcache_logged():
    body = {
        "model": "smollm2-135m",
        "lmcache": "0.5.6",
        "vllm": "0.32.0",
        "requests": [
            {"request": "first", "prompt_tokens": 3389, "cached_tokens": 0, "answer": " 700"},
            {"request": "repeat", "prompt_tokens": 3389, "cached_tokens": 0, "answer": " 700"},
        ],
        "lmcache_errors": exceptions_in(LOG),
    }
    text = markdown(body)
    assert "LMCache 0.5.6's connector in vLLM 0.32.0 (smollm2-135m)" in text
    assert "| repeat | 3389 | 0 | ' 700' |" in text
    assert text.endswith("LMCache logged: RuntimeError: No supported cpu connector found.")
    assert markdown({**body, "lmcache_errors": []}).endswith("LMCache logged: no exception")


def test_the_prompt_counts_so_any_answer_can_be_checked():
    assert counting_prompt(4) == "0, 1, 2, 3,"
