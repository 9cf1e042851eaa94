"""docs/bitstream.md states what the code reads and writes: the supported format versions
and every codec's id."""

from __future__ import annotations

import importlib
import pkgutil
import re

import cachegen_lab.codecs
from cachegen.codec import api, base
from cachegen.codec.coding import bitstream
from tests.support import REPO

DOC = (REPO / "docs" / "bitstream.md").read_text()


def _codecs() -> dict[int, str]:
    """Every codec class's id and name: the core's and those of ``cachegen_lab.codecs`` (not
    the test doubles of other test modules)."""
    for module in pkgutil.iter_modules(cachegen_lab.codecs.__path__):
        importlib.import_module(f"{cachegen_lab.codecs.__name__}.{module.name}")
    found, todo = {}, [base.Codec]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if "codec_id" in vars(cls) and cls.__module__.startswith(("cachegen.", "cachegen_lab.")):
            found[cls.codec_id] = cls.name
    return found


def _table_row(field: str) -> str:
    """The text of the header table's row for ``field``."""
    rows = [line for line in DOC.splitlines() if line.startswith("|") and field in line]
    assert len(rows) == 1, f"docs/bitstream.md has {len(rows)} header rows for {field!r}"
    return rows[0]


def test_the_docs_state_the_versions_the_reader_takes():
    versions = bitstream.VERSIONS
    assert versions == tuple(range(1, bitstream.VERSION + 1))
    span = f"{versions[0]} to {versions[-1]}"
    assert DOC.splitlines()[0] == f"# The cachegen bitstream, versions {span}"
    assert f"format version ({span})" in _table_row("format version")
    assert f"reader accepts versions {span} " in " ".join(DOC.split())


def test_the_docs_codec_id_table_lists_every_codec():
    row = _table_row("codec id:")
    listed = {int(i): name for i, name in re.findall(r"(\d+) ([a-z][\w-]*)", row.split(":")[1])}
    codecs = _codecs()
    assert listed == codecs
    assert api.RESERVED_IDS.items() <= codecs.items()
