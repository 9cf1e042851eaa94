"""The store census of a fleet run: what a run added to a real directory store, by kind and
form, and every added entry read back."""

from __future__ import annotations

import torch

from cachegen.codec import get_codec
from cachegen.kv import KVCache, ModelIdentity
from cachegen.store import SLIDING, RecordAddress, open_store
from cachegen_lab.fleet import census

# Key scopes: a scope belongs to one codec (a form's slot does not name its codec).
INT8, FP8, CACHEGEN = "0123456789abcdef", "1123456789abcdef", "2123456789abcdef"
MODEL = ModelIdentity("census-model", "c" * 64, num_layers=2, num_kv_heads=1, head_dim=8)


def _bitstream(codec: str, first_token: int, tokens: int = 8) -> bytes:
    """A real bitstream of ``codec``: a tiny chunk of ``tokens`` tokens from ``first_token``."""
    shape = (MODEL.num_layers, MODEL.num_kv_heads, tokens, MODEL.head_dim)
    g = torch.Generator().manual_seed(first_token)
    kv = KVCache(
        torch.randn(shape, generator=g).bfloat16(),
        torch.randn(shape, generator=g).bfloat16(),
        torch.arange(first_token, first_token + tokens),
        MODEL,
    )
    return get_codec(codec).encode(kv)


def test_the_census_counts_only_new_entries_and_finds_one_that_does_not_verify(tmp_path):
    url = tmp_path.as_uri()
    a_int8, a_fp8 = _bitstream("int8", 0), _bitstream("fp8", 0)
    a_sliding, b_int8 = _bitstream("int8", 100), _bitstream("int8", 200)
    junk = {"cachegen-11": b"d" * 40, "cachegen-11-packed": b"e" * 30}  # not bitstreams
    with open_store(url) as store:
        store.write(RecordAddress.of(f"{INT8}/old", "int8"), b"x" * 100)
        before = census.entries(url)
        store.write(RecordAddress.of(f"{INT8}/a", "int8"), a_int8)
        store.write(RecordAddress.of(f"{INT8}/a", "int8", SLIDING), a_sliding)
        store.write(RecordAddress.of(f"{INT8}/b", "int8"), b_int8)
        store.write(RecordAddress.of(f"{FP8}/a", "fp8"), a_fp8)
        for form, payload in junk.items():  # two records of one key
            store.write(RecordAddress.of(f"{CACHEGEN}/c", form), payload)
    assert [(key, size) for (key, _), size in before.items()] == [(f"{INT8}/old", 100)]

    path = next(p for p in tmp_path.rglob("*") if p.is_file() and p.read_bytes().endswith(b_int8))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # the payload of b's record no longer matches its checksum
    path.write_bytes(bytes(data))

    wrote = census.written(url, before)
    int8 = len(a_int8) + len(a_sliding) + len(b_int8)
    full = int8 - len(a_sliding) + len(a_fp8) + 70
    assert (wrote["chunks"], wrote["entries"]) == (5, 6)
    assert wrote["payload_bytes"] == int8 + len(a_fp8) + 70
    assert wrote["kinds"] == {
        "full": {"entries": 5, "payload_bytes": full},
        "sliding": {"entries": 1, "payload_bytes": len(a_sliding)},
    }
    # Each record by the form its header names (b's, corrupt past its header, still names
    # int8), and by none where it is not a bitstream.
    assert wrote["forms"] == {
        "int8": {"entries": 3, "payload_bytes": int8},
        "fp8": {"entries": 1, "payload_bytes": len(a_fp8)},
        "unknown": {"entries": 2, "payload_bytes": 70},
    }
    assert wrote["unreadable"] == 1
