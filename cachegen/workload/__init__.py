"""Every text and task the project measures on, with named splits that are disjoint by
construction.

The text is the Python documentation that ships with CPython (``pydoc_data.topics``), so it
is there on every machine, offline. Its topics are split three ways:

``tables``
    the first six topic names in sorted order: the codec profile's probability tables are
    calibrated on them (``cachegen.profiles``).
``calibrate``
    one topic in five of the others, by a stable hash of its name: ``cachegen calibrate``
    chooses codec levels on it.
``eval``
    the remaining topics, less every paragraph that shares a run of ``OVERLAP_UNITS`` words
    or symbols with the two splits above (the documentation repeats whole passages across
    topics): every measurement (quality, sizes, speed, bench prompts) uses this split.

Held-out evaluation domains (:data:`DOMAINS`, :func:`domain_text`), for measuring quality on
more than one kind of text:

``pydoc``
    the ``eval`` split above.
``prose``
    *The Adventures of Sherlock Holmes* (Arthur Conan Doyle), shipped in ``texts/prose.txt``.
``code``
    the Python source of :data:`CODE_MODULES`, read from the running interpreter's standard
    library (like ``pydoc_data``, nothing is shipped).
``dialogue``
    Shakespeare's plays as collected in "tinyshakespeare", shipped in ``texts/dialogue.txt``.
``legal``
    eight free-software and free-content licences (Apache 2.0, GPL 3, LGPL 2.1, MPL 2.0,
    GFDL 1.3, MPL 1.1, Artistic, CC0 1.0), verbatim, shipped in ``texts/legal.txt``.
``science``
    Isaac Newton's *Opticks* (fourth edition, 1730), a treatise of experiments on light,
    shipped in ``texts/science.txt``.

Each domain other than ``pydoc`` is its text less every paragraph (blank-line separated block,
for code too) that shares a run of ``OVERLAP_UNITS`` words or symbols with the calibration
text (the ``tables`` and ``calibrate`` splits), the same filter as ``eval``. Where the shipped
texts come from and how they were cut: ``texts/SOURCES.md``.

Tasks: :mod:`cachegen.workload.retrieval` (a LongChat-style line-retrieval task generated
with a fixed seed) and :mod:`cachegen.workload.passkey` (a 5-digit key hidden at a chosen
depth of a filler context). Evaluation cases are :class:`cachegen.workload.window.Window`.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import re
from pathlib import Path

from cachegen.errors import InputError

SPLITS = ("tables", "calibrate", "eval")
DOMAINS = ("pydoc", "prose", "code", "dialogue", "legal", "science")  # `pydoc` is the `eval` split
# Standard library modules whose source is the `code` domain: pure Python of varied kinds
# (command lines, parsers, algorithms, numbers, dates, text, networking, metaprogramming).
CODE_MODULES = (
    "argparse",
    "calendar",
    "configparser",
    "dataclasses",
    "difflib",
    "fractions",
    "heapq",
    "ipaddress",
    "json.decoder",
    "shlex",
    "statistics",
    "string",
    "textwrap",
    "tomllib._parser",
    "urllib.parse",
)
TABLES_TOPICS = 6
CALIBRATION_SHARE = 5  # one topic in five (outside the tables split) goes to `calibrate`
OVERLAP_UNITS = (
    6  # an eval paragraph shares no run of this many words or symbols with calibration text
)
SOURCE = "pydoc_data.topics (CPython documentation)"

_UNIT = re.compile(r"\w+|[^\w\s]")


def _topics() -> dict[str, str]:
    from pydoc_data.topics import topics

    return topics


def topics(split: str) -> list[str]:
    """Names of the ``pydoc_data.topics`` in ``split``, sorted."""
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    names = sorted(_topics())
    if split == "tables":
        return names[:TABLES_TOPICS]
    out = []
    for name in names[TABLES_TOPICS:]:
        # A stable hash (not Python's salted hash()) so the split is the same on every machine.
        bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % CALIBRATION_SHARE
        if (bucket == 0) == (split == "calibrate"):
            out.append(name)
    return out


@functools.lru_cache(maxsize=len(SPLITS))
def text(split: str) -> str:
    """The text of ``split``: its topics (for ``eval``, their surviving paragraphs) joined by
    blank lines."""
    documents = _topics()
    joined = "\n\n".join(documents[name].strip() for name in topics(split))
    if split != "eval":
        return joined
    return _held_out(joined)


@functools.lru_cache(maxsize=len(DOMAINS))
def domain_text(domain: str) -> str:
    """The held-out text of evaluation ``domain`` (one of :data:`DOMAINS`): for ``pydoc`` the
    ``eval`` split, for the others their surviving paragraphs joined by blank lines."""
    if domain not in DOMAINS:
        raise InputError(f"unknown domain {domain!r}; use one of {', '.join(DOMAINS)}")
    if domain == "pydoc":
        return text("eval")
    if domain == "code":
        return _held_out("\n\n".join(_module_source(name) for name in CODE_MODULES))
    shipped = Path(__file__).with_name("texts") / f"{domain}.txt"
    return _held_out(shipped.read_text(encoding="utf-8"))


def _module_source(name: str) -> str:
    """The source of standard library module ``name``, read from its file (not imported)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise InputError(
            f"the 'code' domain needs the Python source of the standard library module {name!r}, "
            "which this interpreter does not have"
        )
    return Path(spec.origin).read_text(encoding="utf-8").strip()


def _held_out(joined: str) -> str:
    """``joined`` less every paragraph that shares a run with the calibration text."""
    paragraphs = [p for p in re.split(r"\n\s*\n", joined) if p.strip()]
    return "\n\n".join(_without_overlap(paragraphs, text("tables") + "\n\n" + text("calibrate")))


def _without_overlap(paragraphs: list[str], reference: str) -> list[str]:
    """``paragraphs`` less every one that a run shared with ``reference`` touches. Runs may
    span paragraphs (the documentation has many one-line paragraphs), so the check runs over
    the joined text and repeats until dropping paragraphs creates no new shared run."""
    n = OVERLAP_UNITS
    seen = _runs(reference)
    while True:
        units, owner = [], []
        for index, paragraph in enumerate(paragraphs):
            found = _UNIT.findall(paragraph)
            units += found
            owner += [index] * len(found)
        touched = set()
        for i, run in enumerate(_windows(units, n)):
            if tuple(run) in seen:
                touched.update(owner[i : i + n])
        if not touched:
            return paragraphs
        paragraphs = [p for i, p in enumerate(paragraphs) if i not in touched]


def _windows(units: list[str], n: int):
    return (units[i : i + n] for i in range(len(units) - n + 1))


def _runs(passage: str) -> set[tuple[str, ...]]:
    """Every run of ``OVERLAP_UNITS`` words or symbols in ``passage``."""
    return {tuple(run) for run in _windows(_UNIT.findall(passage), OVERLAP_UNITS)}


def bench_question(repeat: int) -> str:
    """The question asked after a bench context in repeat ``repeat`` (distinct per repeat, so
    only the context can come from a cache)."""
    return f"\n\nQuestion {repeat + 1}: In one sentence, what does the text above explain?\nAnswer:"


SUMMARY_QUESTION = "\n\nQuestion: Summarize the text above in one sentence.\nAnswer:"
