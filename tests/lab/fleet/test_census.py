"""The store census of a fleet run: what a run added to a real directory store, by kind and
level, and every added entry read back."""

from __future__ import annotations

from cachegen.store import open_store
from cachegen_lab.fleet import census

NS = "0123456789abcdef"


def test_the_census_counts_only_new_entries_and_finds_one_that_does_not_verify(tmp_path):
    url = tmp_path.as_uri()
    with open_store(url) as store:
        store.put(f"{NS}/old", 3, b"x" * 100)
        before = census.entries(url)
        store.put(f"{NS}/a", 3, b"a" * 10)
        store.put(f"{NS}/a", 5, b"b" * 20)
        store.put(f"{NS}/a-sliding", 3, b"c" * 30)
        store.put(f"{NS}/b", 3, b"d" * 40)
    assert before == {(f"{NS}/old", 3): 100}

    path = next(p for p in tmp_path.rglob("*") if p.is_file() and b"dddd" in p.read_bytes())
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload of (b, 3) no longer matches its checksum
    path.write_bytes(bytes(data))

    wrote = census.written(url, before)
    assert (wrote["chunks"], wrote["entries"], wrote["payload_bytes"]) == (3, 4, 100)
    assert wrote["kinds"] == {
        "full": {"entries": 3, "payload_bytes": 70},
        "sliding": {"entries": 1, "payload_bytes": 30},
    }
    assert wrote["levels"] == {
        "3": {"entries": 3, "payload_bytes": 80},
        "5": {"entries": 1, "payload_bytes": 20},
    }
    assert wrote["unreadable"] == 1
