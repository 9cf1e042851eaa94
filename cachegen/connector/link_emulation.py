"""The connector's one seam to the lab's link emulation: the ``cachegen.links`` entry point.

A request's ``bandwidth_mbps`` and ``rtt_ms`` (experiments) load over an emulated link, which
``cachegen_lab.network`` opens. The connector finds that opener at run time, only once those
options are set, so the library's imports never load the lab (the layer contract holds).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from cachegen.connector.errors import ConnectorError

ENTRY_POINT_GROUP = "cachegen.links"
ENTRY_POINT_NAME = "open_link"
# open_link(store, *, bandwidth_mbps, rtt_ms, shaper): a context manager yielding a Link
LinkOpener = Callable[..., Any]


@functools.cache
def _find_opener() -> tuple[LinkOpener | None, str]:
    """The opener, or None and why it is missing; looked up once per process."""
    for entry in entry_points(group=ENTRY_POINT_GROUP, name=ENTRY_POINT_NAME):
        try:
            return entry.load(), ""
        except Exception as exc:  # a broken lab must leave loads without emulation usable
            return None, f"{entry.value} did not load ({type(exc).__name__}: {exc})"
    return None, f"no {ENTRY_POINT_GROUP!r} entry point {ENTRY_POINT_NAME!r} is installed"


def link_opener() -> LinkOpener:
    """The lab's ``open_link``, or a ConnectorError saying why an emulated link cannot open."""
    opener, why = _find_opener()
    if opener is None:
        raise ConnectorError(
            "bandwidth_mbps and rtt_ms emulate a link for experiments (cachegen_lab.network), "
            f"but {why}; reinstall cachegen (`pip install -e .` in a checkout) or drop them"
        )
    return opener
