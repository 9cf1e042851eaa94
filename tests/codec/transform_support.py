"""Checks the transform codecs (kvtc, turboquant, tcq) share: their fitted files (a kvtc basis,
a tcq model file) are content-addressed and guarded the same way, and their bitstreams are
read by the documented layout alike (``from tests.codec.transform_support import``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from cachegen import workload
from cachegen.codec import CodecError, decode, inspect
from cachegen.codec.coding.bitstream import pack_frame, parse_frames, parse_header
from cachegen.codec.tcq import model as tcq_model
from cachegen.codec.transform import basis as transform
from cachegen.kv import KVCache

TEXT = "\n\n".join(
    ["The quick brown fox jumps over the lazy dog. " * 12, "def f(x):\n    return x * 2\n" * 12]
)


def forget_fitted_files() -> None:
    """Drop the kvtc bases and tcq model files read so far, so the next use reads the disk."""
    transform.forget_cached_bases()
    tcq_model.forget_cached_tcq_models()


@contextlib.contextmanager
def own_profile_dir(path: Path) -> Iterator[Path]:
    """``path`` as the profile directory (CACHEGEN_PROFILE_DIR), with no basis nor model file
    read before it remembered, and none read in it remembered after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHEGEN_PROFILE_DIR", str(path))
        forget_fitted_files()
        try:
            yield path
        finally:
            forget_fitted_files()


def f32(kv: KVCache) -> torch.Tensor:
    return torch.stack([kv.keys, kv.values]).to(torch.float32)


def relative_error(out: KVCache, kv: KVCache) -> float:
    return float((f32(out) - f32(kv)).norm() / f32(kv).norm())


# ---- the fitted file -----------------------------------------------------------------------


def fit_recording_splits(monkeypatch, fit: Callable[[], object]) -> tuple[object, list[str]]:
    """What ``fit()`` returns, and the workload splits it read text from."""
    read: list[str] = []
    original = workload.text

    def recording_text(split):
        read.append(split)
        return original(split)

    monkeypatch.setattr(workload, "text", recording_text)
    return fit(), read


def read_back(fitted, path: Path, parse: Callable):
    """``fitted`` (a basis or a model file) parsed again from ``path``, the file named by its
    id: the same size, id and levels."""
    assert path.is_file() and path.stat().st_size == fitted.nbytes
    again = parse(path.read_bytes(), str(path), fitted.id)
    assert again.id == fitted.id and again.levels == fitted.levels
    return again


def check_reference(ref_path: Path, module, field: str, fitted_id: str) -> None:
    """The model's reference file names ``fitted_id`` under ``field``, in ``module``'s
    schema and version (REF_SCHEMA, REF_VERSION)."""
    ref = json.loads(ref_path.read_text())
    assert (ref["schema"], ref["version"], ref[field]) == (
        module.REF_SCHEMA,
        module.REF_VERSION,
        fitted_id,
    )


@contextlib.contextmanager
def restored_afterwards(path: Path) -> Iterator[bytes]:
    """The bytes of ``path``, written back (and the files read forgotten) however the block
    leaves it."""
    good = path.read_bytes()
    try:
        yield good
    finally:
        path.write_bytes(good)
        forget_fitted_files()


def check_corrupt_file_is_detected(blob: bytes, tokens: int, path: Path, parse: Callable) -> None:
    """A flipped byte in the fitted file ``path`` that ``blob`` names is found by its checksum
    (with or without the id to compare), a truncated one is unreadable, and a missing one is
    asked for; ``blob`` decodes (its ``tokens`` tokens) again once the file is back."""
    with restored_afterwards(path) as good:
        bad = bytearray(good)
        bad[-100] ^= 0x01
        path.write_bytes(bytes(bad))
        forget_fitted_files()
        with pytest.raises(CodecError, match="corrupt"):
            decode(blob)
        # without the id to compare, the header's checksum of the arrays still catches it
        with pytest.raises(CodecError, match="checksum of the arrays"):
            parse(bytes(bad), "test")
        with pytest.raises(CodecError, match="unreadable"):
            parse(good[:-8], "test")
        path.unlink()
        forget_fitted_files()
        with pytest.raises(CodecError, match="copy"):
            decode(blob)
    assert decode(blob).num_tokens == tokens


def check_another_model_is_refused(codec, kv: KVCache, other_spec, find: Callable) -> None:
    """``codec`` (fitted for ``kv``'s model) refuses KV of ``other_spec``, ``find`` (the
    fitted file by id) refuses the other model, and an unknown level is refused."""
    from cachegen.extract import extract_kv

    other = extract_kv(other_spec, text="Another model entirely. " * 8)
    with pytest.raises(CodecError, match="fitted for model"):
        codec.encode(other)
    with pytest.raises(CodecError, match="fitted for model"):
        find(other.model)
    with pytest.raises(CodecError, match="no level 7"):
        codec.encode(kv, level=7)


# ---- bad bitstreams ------------------------------------------------------------------------


def check_truncated_and_flipped_are_refused(blob: bytes) -> None:
    """Every cut of ``blob`` and 40 single-bit flips in it are refused."""
    for cut in range(1, len(blob), max(1, len(blob) // 40)):
        with pytest.raises(CodecError):
            decode(blob[:cut])
    rng = np.random.default_rng(0)
    for position in rng.integers(0, len(blob), 40):
        bad = bytearray(blob)
        bad[position] ^= 1 << int(rng.integers(0, 8))
        with pytest.raises(CodecError):
            decode(bytes(bad))


def reframe(blob: bytes, body) -> bytes:
    """``blob`` with its first frame's body replaced (checksums recomputed)."""
    header = parse_header(blob)
    frames = parse_frames(blob, header)
    first = pack_frame(torch.from_numpy(frames[0].token_ids), header.token_width, body)
    return bytes(blob[: header.size]) + first + bytes(blob[header.size + frames[0].size :])


# ---- sizes and the command line ------------------------------------------------------------


def check_every_byte_is_counted(blob: bytes, kv: KVCache) -> tuple[dict, int]:
    """``inspect`` accounts for every byte of ``blob``: its bits per element, and the layers'
    bytes with the headers' and token ids'; returns the report and the layers' bytes."""
    info = inspect(blob)
    assert info["bytes"] == len(blob)
    assert info["bits_per_element"] == pytest.approx(len(blob) * 8 / kv.num_elements)
    layer_bytes = sum(r["key_bytes"] + r["value_bytes"] for r in info["layers"])
    overhead = info["header_bytes"] + info["frame_header_bytes"] + info["token_id_bytes"]
    assert layer_bytes + overhead == pytest.approx(len(blob))
    return info, layer_bytes


def cli_eval_rows(capsys, tmp_path: Path, codecs: list[str]) -> list[tuple[str, str]]:
    """(codec, level) of each row `cachegen eval --json` prints for ``--codec`` ``codecs`` on
    one short window of tiny-llama."""
    from cachegen.cli import main

    text = tmp_path / "notes.txt"
    text.write_text("A plain text file about nothing in particular, told twice over. " * 60)
    code = main(
        ["eval", "--model", "tiny-llama", "--dataset", str(text), "--windows", "1"]
        + ["--context-tokens", "96", "--continuation-tokens", "16", "--gen-tokens", "4"]
        + [arg for codec in codecs for arg in ("--codec", codec)]
        + ["--no-progress", "--json"]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return [(r["codec"], r["level"]) for r in json.loads(out)]


# ---- the documented layouts (docs/bitstream.md), read by hand so the doc cannot drift ----


def decoded_and_original(blob: bytes, part: KVCache) -> tuple[KVCache, np.ndarray, torch.Tensor]:
    """``blob`` decoded (float32), its keys and values stacked [2, L, H, T, D] (numpy), and
    those of ``part``, what was encoded, as stored."""
    decoded = decode(blob, out_dtype=torch.float32)
    got = torch.stack([decoded.keys, decoded.values]).numpy()
    return decoded, got, torch.stack([part.keys, part.values])


def check_exact_tokens(body: bytes, original: torch.Tensor, offset: int, count: int) -> int:
    """A frame body starts with ``count`` tokens (from ``offset``) of ``original`` [2, L, H,
    T, D] byte for byte, keys then values; returns how many bytes they take."""
    want = original[:, :, :, offset : offset + count].contiguous().view(torch.uint8)
    exact = body[: want.numel()]
    assert exact == want.numpy().tobytes()
    return len(exact)


def check_synthesized(rows: np.ndarray, coded: np.ndarray, theta: float, positions) -> None:
    """Rows ``[m, H * D]`` synthesized by the documented arithmetic, keys turned NeoX-style
    by ``theta`` at ``positions`` (0: not turned), against what the decoder gave ``[H, m, D]``."""
    H, m, D = coded.shape
    heads = rows.reshape(m, H, D).transpose(1, 0, 2)
    if theta:
        heads = neox_rotate(heads, np.asarray(positions), theta)
    assert np.allclose(heads, coded, rtol=1e-4, atol=1e-4 * np.abs(coded).max())


def neox_rotate(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Keys ``[..., tokens, D]`` rotated NeoX-style: pair (j, j + D/2) by p * theta^(-2j/D)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(np.float64) * theta ** (-2 * np.arange(half) / (2 * half))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
