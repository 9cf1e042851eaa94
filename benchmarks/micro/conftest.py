"""Conventions for the pytest-benchmark micro-benchmarks
(``pytest benchmarks/micro --benchmark-only``).

* Grouping: a benchmark without an explicit ``@pytest.mark.benchmark(group=...)`` is grouped
  by its file (``test_codec_speed.py`` -> ``codec_speed``), so a run prints one comparison
  table per area.
* Sizes: put what one call processes into ``benchmark.extra_info`` under ``elements`` (KV
  elements), ``bytes`` or ``tokens``; the saved JSON (``--benchmark-json``) then also gets
  ``<key>_per_s`` computed from the median time, unless the test recorded its own.
* The saved JSON carries the machine and versions (``cachegen_environment``), as
  results.json does.

The normal test run (`make test`) passes ``--benchmark-skip``, so none of this runs there.
"""

from __future__ import annotations

import pytest

SIZE_KEYS = ("elements", "bytes", "tokens")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "benchmark" not in getattr(item, "fixturenames", ()):
            continue
        marker = item.get_closest_marker("benchmark")
        kwargs = dict(marker.kwargs) if marker is not None else {}
        if "group" not in kwargs:
            kwargs["group"] = item.module.__name__.rpartition(".")[2].removeprefix("test_")
            item.add_marker(pytest.mark.benchmark(**kwargs), append=False)


def pytest_benchmark_update_json(config, benchmarks, output_json):
    from cachegen_lab.bench import environment

    output_json["cachegen_environment"] = environment.capture()
    for bench in output_json.get("benchmarks", []):
        info = bench.setdefault("extra_info", {})
        median = (bench.get("stats") or {}).get("median")
        if not median:
            continue
        for key in SIZE_KEYS:
            if isinstance(info.get(key), (int, float)):
                info.setdefault(f"{key}_per_s", info[key] / median)
