"""Tests every peer codec's stream must pass, imported by each peer's test module (which
defines its own ``blob`` fixture: a stream of that codec)."""

from __future__ import annotations

import pytest

from cachegen.codec import CodecError, decode


@pytest.mark.parametrize("cut", [1, 100, 4000])
def test_truncated_stream_is_refused(blob, cut):
    with pytest.raises(CodecError):
        decode(blob[:-cut])


def test_flipped_byte_is_refused_by_the_frame_checksum(blob):
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x40
    with pytest.raises(CodecError, match="corrupt"):
        decode(bytes(damaged))
