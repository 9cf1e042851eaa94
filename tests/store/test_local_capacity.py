"""A directory store's ``max_bytes`` bounds the directory, not one writer: every store object
(in any process) that writes it counts into one shared count, under the directory's lock."""

from __future__ import annotations

import json

from cachegen.store import open_store

CAP = 10_000
RECORD = 1000


def _stored(store) -> int:
    return store.stats().payload_bytes


def _counted(root) -> int:
    doc = json.loads((root / "usage.json").read_text())
    assert (doc["schema"], doc["version"]) == ("cachegen-store-usage", 1)
    return doc["payload_bytes"]


def test_two_writers_of_one_directory_share_its_capacity(tmp_path):
    root = tmp_path / "s"
    first = open_store(root.as_uri() + f"?max_bytes={CAP}")
    second = open_store(root.as_uri() + f"?max_bytes={CAP}")
    for i in range(30):  # each writes 15 records: alone, each would stay under the bound
        (first if i % 2 else second).put(f"ns/k{i:02d}", 0, b"y" * RECORD)
        assert _stored(first) <= CAP
    assert _counted(root) == _stored(first)
    assert first.exists("ns/k29", 0) and not first.exists("ns/k00", 0)


def test_the_count_follows_replacements_deletions_and_unbounded_writers(tmp_path):
    root = tmp_path / "s"
    bounded = open_store(root.as_uri() + f"?max_bytes={CAP}")
    unbounded = open_store(root.as_uri())  # counts too, once a bounded writer keeps a count
    bounded.put("ns/a", 0, b"a" * RECORD)
    unbounded.put("ns/a", 0, b"a" * (3 * RECORD))  # replaces: counted as the difference
    unbounded.put("ns/b", 0, b"b" * RECORD)
    assert _counted(root) == _stored(bounded) == 4 * RECORD
    assert unbounded.delete("ns/b") == 1
    assert _counted(root) == _stored(bounded) == 3 * RECORD
    for i in range(6):
        unbounded.put(f"ns/u{i}", 0, b"u" * RECORD)  # 9 records: over the bound, not evicted
    assert _counted(root) == _stored(bounded) == 9 * RECORD
    bounded.put("ns/c", 0, b"c" * (2 * RECORD))  # the bounded writer sees everyone's bytes
    assert _stored(bounded) <= CAP * 0.9
    assert _counted(root) == _stored(bounded)
    (root / "usage.json").write_text("not json")  # a damaged count is rebuilt from the files
    bounded.put("ns/d", 0, b"d" * RECORD)
    assert _counted(root) == _stored(bounded)
