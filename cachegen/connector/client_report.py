"""What a request's report tells its client (the engine option ``client_report``).

The report travels back to the API client in ``kv_transfer_params``. A store's error text names
hosts, paths and chunk keys, and the exact tokens loaded tell any client of an unsalted engine
whether someone sent the same prefix before; the server's log and ``/metrics`` have both.
``reasons`` (the default) keeps reason codes only; ``full`` keeps every figure and error text,
for trusted clients and measurements; ``none`` sends no report.
"""

from __future__ import annotations

from typing import Any

REASON_KEYS = ("schema", "version", "mode", "fallback", "save_skipped", "salted")
# fallbacks whose error text is about the client's own request (its options, its prompt_embeds)
OWN_INPUT_FALLBACKS = ("bad_options", "prompt_embeds")


def for_client(report: dict[str, Any], setting: str) -> dict[str, Any] | None:
    """``report`` as ``setting`` (``client_report``) lets the client see it; None: nothing."""
    if setting == "full":
        return report
    if setting == "none":
        return None
    view = {key: report[key] for key in REASON_KEYS if key in report}
    if report.get("fallback") in OWN_INPUT_FALLBACKS and "error" in report:
        view["error"] = report["error"]
    return view
