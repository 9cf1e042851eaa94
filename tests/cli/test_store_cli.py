"""`cachegen store ...` end to end: a real KV directory, a real codec, a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cachegen.cli import main
from cachegen.kv import KVCache


@pytest.fixture
def kv_dir(tmp_path, tiny_llama):
    ident = tiny_llama.identity()
    g = torch.Generator().manual_seed(0)
    shape = (ident.num_layers, ident.num_kv_heads, 600, ident.head_dim)
    kv = KVCache(torch.randn(shape, generator=g).bfloat16(),
                 torch.randn(shape, generator=g).bfloat16(), torch.arange(600), ident)  # fmt: skip
    return kv.save(tmp_path / "kv")


def run(capsys, *argv) -> dict | list:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_put_lookup_ls_stats_evict(tmp_path, kv_dir, capsys):
    url = (tmp_path / "store").as_uri()
    put = run(capsys, "store", "put", str(kv_dir), "--codec", "int8", "--store", url, "--json")
    assert put["chunks"] == 3 and put["levels"] == [0] and put["bytes"] > 0
    look = run(capsys, "store", "lookup", str(kv_dir), "--codec", "int8", "--store", url, "--json")
    assert look["stored_prefix_chunks"] == 3 and look["stored_prefix_tokens"] == 600
    listing = run(capsys, "store", "ls", "--store", url, "--json")
    assert listing["schema"] == "cachegen-store-ls" and len(listing["entries"]) == 3
    stats = run(capsys, "store", "stats", "--store", url, "--json")
    assert (put["schema"], stats["schema"]) == ("cachegen-store-put", "cachegen-store-stats")
    assert {put["version"], look["version"], stats["version"]} == {1}
    assert stats["entries"] == 3 and stats["payload_bytes"] == put["bytes"]
    key = put["keys"][1]
    got = tmp_path / "chunk.bin"
    run(
        capsys,
        "store",
        "get",
        "--store",
        url,
        "--key",
        key,
        "--form",
        "int8",
        "--out",
        str(got),
        "--json",
    )
    from cachegen.codec import decode

    assert decode(got.read_bytes()).token_ids.tolist() == list(range(256, 512))
    run(capsys, "store", "rm", "--store", url, "--key", put["keys"][0], "--json")
    look = run(capsys, "store", "lookup", str(kv_dir), "--codec", "int8", "--store", url, "--json")
    assert look["stored_prefix_chunks"] == 0  # the prefix is broken at chunk 0
    assert (
        run(capsys, "store", "evict", "--store", url, "--all", "--json")["payload_bytes_left"] == 0
    )


def _int8_bitstream(tmp_path, kv_dir) -> Path:
    from cachegen.codec import get_codec

    chunk = KVCache.load(kv_dir).chunks(256)[0]
    blob = tmp_path / "b.bin"
    blob.write_bytes(get_codec("int8").encode(chunk))
    return blob


def test_put_blob_and_errors(tmp_path, kv_dir, capsys):
    url = (tmp_path / "store").as_uri()
    blob = _int8_bitstream(tmp_path, kv_dir)
    common = ["--store", url, "--key", "ns/k"]
    put = run(capsys, "store", "put-blob", str(blob), *common, "--form", "int8", "--json")
    assert put["bytes"] == blob.stat().st_size and put["form"] == "int8"
    listing = run(capsys, "store", "ls", "--store", url, "--json")
    assert [e["form"] for e in listing["entries"]] == ["int8"]
    assert (
        main(["store", "get", *common, "--form", "cachegen-3", "--out", str(tmp_path / "o")]) == 1
    )
    assert "is not in" in capsys.readouterr().err
    assert main(["store", "get", *common, "--form", "raw", "--out", str(tmp_path / "o")]) == 1
    assert "the record holds the form int8, not raw" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    bad_key = ["--store", url, "--key", "../x", "--form", "int8"]
    assert main(["store", "put-blob", str(blob), *bad_key]) == 1
    assert "invalid chunk key" in capsys.readouterr().err
    assert main(["store", "put-blob", str(blob), *common, "--form", "fp8"]) == 1
    assert "holds the form int8, not fp8" in capsys.readouterr().err
    (tmp_path / "junk").write_bytes(b"bits")
    assert main(["store", "put-blob", str(tmp_path / "junk"), *common, "--form", "int8"]) == 1
    assert "is not a bitstream" in capsys.readouterr().err
    assert main(["store", "stats", "--store", "gopher://x"]) == 1


def test_stats_count_each_chunks_raw_bf16_once(tmp_path, tiny_llama, capsys):
    """``raw_bf16_bytes`` counts a chunk's KV once whatever codecs' keys hold it (a mixed save
    ladder's), its layer parts add up to one copy, and separate copies count each: the same
    tokens under another key scope of one codec, other tokens at the same position."""
    from cachegen.codec import get_codec
    from cachegen.store import chunk_keys, open_store
    from cachegen.store.keys import sliding_key

    ident, weights = tiny_llama.identity(), tiny_llama.served_weights()
    g = torch.Generator().manual_seed(0)
    shape = (ident.num_layers, ident.num_kv_heads, 512, ident.head_dim)
    kv = KVCache(torch.randn(shape, generator=g).bfloat16(),
                 torch.randn(shape, generator=g).bfloat16(), torch.arange(512), ident)  # fmt: skip
    other = KVCache(kv.keys, kv.values, torch.arange(1000, 1512), ident)  # other tokens
    copy = kv.nbytes  # both chunks' raw bf16 KV, once
    url = (tmp_path / "store").as_uri()

    def put(store, name: str, kv: KVCache, *, parts=False, salt=None, frame_tokens=256) -> None:
        codec = get_codec(name, chunk_tokens=frame_tokens)
        keys = chunk_keys(ident, codec.profile_id, kv.token_ids, 256, weights=weights, salt=salt)
        for key, chunk in zip(keys, kv.chunks(256)):
            if parts:  # as a model with sliding-window layers stores a chunk: two records
                store.put(key, 0, codec.encode(chunk.select_layers([0, 1])))
                store.put(sliding_key(key), 0, codec.encode(chunk.select_layers([2, 3])))
            else:
                store.put(key, 0, codec.encode(chunk))

    def stats() -> dict:
        return run(capsys, "store", "stats", "--store", url, "--json")

    with open_store(url) as store:
        put(store, "int8", kv)
    assert stats()["raw_bf16_bytes"] == copy
    with open_store(url) as store:
        put(store, "raw", kv, parts=True)  # another codec's keys, in parts
        # a third's, two frames a record: the second frame's ids are past the first read
        put(store, "fp8", kv, frame_tokens=128)
    got = stats()
    assert (got["chunks"], got["entries"]) == (8, 8)
    assert got["raw_bf16_bytes"] == copy
    assert got["payload_to_raw"] == round(got["payload_bytes"] / copy, 4)
    with open_store(url) as store:
        put(store, "raw", kv, parts=True, salt="tenant-b")  # another scope: a second copy
    assert stats()["raw_bf16_bytes"] == 2 * copy
    with open_store(url) as store:
        put(store, "int8", other)  # other tokens: other KV
        store.put("ns/not-a-bitstream", 0, b"bits")
    got = stats()
    assert got["raw_bf16_bytes"] == 3 * copy and got["raw_bf16_skipped_keys"] == 1


def test_a_record_is_named_by_its_form_never_by_a_slot(tmp_path, kv_dir, capsys):
    url = (tmp_path / "store").as_uri()
    blob = _int8_bitstream(tmp_path, kv_dir)
    common = ["--store", url, "--key", "ns/k", "--json"]
    run(capsys, "store", "put-blob", str(blob), *common, "--form", "int8")
    out = tmp_path / "o"
    run(capsys, "store", "get", *common, "--form", "int8", "--out", str(out))
    assert out.read_bytes() == blob.read_bytes()
    with pytest.raises(SystemExit):
        main(["store", "get", *common, "--form", "32779", "--out", str(out)])
    assert "write the form 'cachegen-11-packed' instead" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["store", "get", *common, "--form", "11", "--out", str(out)])
    assert "names no codec" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["store", "rm", *common, "--form", "cachegen-11-zipped"])
    assert "unknown form 'cachegen-11-zipped'" in capsys.readouterr().err
    assert run(capsys, "store", "rm", *common, "--form", "int8")["removed"] == 1
