"""`cachegen encode / decode / inspect / profile` from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cachegen.cli import main
from cachegen.codec import decode
from cachegen.kv import KVCache
from tests.support import REPO


@pytest.fixture(scope="module")
def kv_dir(tiny_llama, tmp_path_factory) -> Path:
    from cachegen.extract import extract_kv

    kv = extract_kv(tiny_llama, text="Command line round trip. " * 20)
    return kv.save(tmp_path_factory.mktemp("cli") / "kv")


@pytest.mark.parametrize("codec", ["cachegen", "int8-zstd"])
def test_encode_inspect_decode(codec, kv_dir, tmp_path, capsys):
    blob = tmp_path / "kv.cgkv"
    assert main(["encode", "--codec", codec, "--chunk-tokens", "32", str(kv_dir), str(blob)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(blob), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    original = KVCache.load(kv_dir)
    for field in (
        "codec",
        "level",
        "num_tokens",
        "num_layers",
        "bits_per_element",
        "ratio_vs_fp16",
        "ratio_vs_int8",
        "layers",
    ):
        assert field in info
    assert (
        info["codec"] == codec
        and info["num_tokens"] == original.num_tokens
        and len(info["layers"]) == original.num_layers
    )
    assert main(["inspect", str(blob)]) == 0
    assert "bits/element" in capsys.readouterr().out
    out_dir = tmp_path / "decoded"
    assert main(["decode", "--dtype", "float32", str(blob), str(out_dir)]) == 0
    decoded = KVCache.load(out_dir)
    expected = decode(blob.read_bytes(), out_dtype=torch.float32)
    assert torch.equal(decoded.keys, expected.keys) and torch.equal(
        decoded.token_ids, original.token_ids
    )


def test_encode_level_is_recorded(kv_dir, tmp_path, capsys):
    blob = tmp_path / "kv.cgkv"
    assert (
        main(["encode", "--codec", "cachegen", "--level", "3", "--json", str(kv_dir), str(blob)])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["level"] == 3
    assert (
        main(["encode", "--codec", "cachegen", "--level", "8", str(kv_dir), str(tmp_path / "x")])
        == 1
    )
    assert "no level 8" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_profile_build_then_show(capsys, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEGEN_PROFILE_DIR", str(tmp_path / "profiles"))
    assert main(["profile", "show", "--model", "tiny-llama"]) == 1
    assert "cachegen profile build --model tiny-llama" in capsys.readouterr().err
    assert main(["profile", "build", "--model", "tiny-llama"]) == 0
    capsys.readouterr()
    assert main(["profile", "show", "--model", "tiny-llama"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "cachegen-codec-profile" and data["version"] == 2
    assert data["default_level"] == 2 and set(data["levels"]) >= {"1", "2", "3"}


def test_corrupt_file_fails_with_one_line(kv_dir, tmp_path):
    blob = tmp_path / "kv.cgkv"
    assert main(["encode", "--codec", "int8", str(kv_dir), str(blob)]) == 0
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.cgkv"
    bad.write_bytes(bytes(data))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "cachegen", "decode", str(bad), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "corrupt" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_bad_inputs_fail_cleanly(kv_dir, tmp_path, capsys):
    bad = tmp_path / "bad.cgkv"
    bad.write_bytes(b"CGKV\x01 not really a bitstream")
    assert main(["inspect", str(bad)]) == 1
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert main(["encode", "--codec", "int8", str(tmp_path), str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("cachegen ") and "error" in line for line in err)


@pytest.mark.parametrize("codec, level", [("cachegen", 3), ("tcq", 24)])
def test_encode_packed_form_decodes_like_the_coded_form(codec, level, kv_dir, tmp_path, capsys):
    coded, packed = tmp_path / "coded.cgkv", tmp_path / "packed.cgkv"
    common = ["encode", "--codec", codec, "--level", str(level), "--chunk-tokens", "32"]
    assert main([*common, str(kv_dir), str(coded)]) == 0
    assert main([*common, "--form", "packed", str(kv_dir), str(packed)]) == 0
    assert "(packed)" in capsys.readouterr().out
    assert main(["inspect", str(packed)]) == 0
    text = capsys.readouterr().out
    assert f"level {level}, packed form" in text
    assert codec != "cachegen" or "format version   4" in text
    assert main(["inspect", str(packed), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["form"] == "packed"
    a, b = decode(coded.read_bytes()), decode(packed.read_bytes())
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # the baselines have one form
    out = tmp_path / "int8.cgkv"
    assert main(["encode", "--codec", "int8", "--form", "packed", str(kv_dir), str(out)]) == 1
    err = capsys.readouterr().err
    assert "form of the cachegen and tcq levels" in err and "drop --form" in err
    assert not out.exists()
