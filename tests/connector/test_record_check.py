"""A load checks each record's bitstream header against the chunk it planned before decoding:
the decoder sizes its output from the header, so a forged header (a huge geometry or token
count) is refused on its values, before its frames are read or anything is allocated."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from cachegen.codec import CodecError, decode
from cachegen.codec.coding.bitstream import _FIXED, parse_header
from cachegen.connector.config import RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.load_control import RecordCheck
from cachegen.connector.parts import RecordParts
from cachegen.extract import extract_kv
from cachegen.modes import Form
from cachegen.store import RecordAddress
from tests.support import CHUNK, connector_transport

FIELDS = ("magic", "version", "codec", "level", "dtype", "flags")
FIELDS += ("layers", "heads", "head_dim", "start", "tokens", "chunk")


def forged_header(blob: bytes, **fields) -> bytes:
    """Only the header of ``blob``, with ``fields`` replaced and its checksum made right: no
    frame follows, so a decoder that read on would fail on the missing frames instead."""
    header = parse_header(blob)
    values = dict(zip(FIELDS, _FIXED.unpack_from(blob, 0)))
    values.update(fields)
    data = bytearray(blob[: header.size])
    _FIXED.pack_into(data, 0, *[values[name] for name in FIELDS])
    struct.pack_into("<I", data, header.size - 4, zlib.crc32(bytes(data[: header.size - 4])))
    return bytes(data)


@pytest.fixture(scope="module")
def kv(tiny_llama):
    return extract_kv(tiny_llama, token_ids=torch.arange(2 * CHUNK))


def _check(tiny_llama, kv) -> RecordCheck:
    parts = RecordParts.of(tiny_llama, CHUNK)
    return RecordCheck([(0, None), (1, None)], kv.token_ids.tolist(), kv.model, parts, print)


def test_headers_no_planned_record_has_are_refused_before_the_frames_are_read(tiny_llama, kv):
    from cachegen.codec import get_codec

    blob = get_codec("raw", chunk_tokens=CHUNK).encode(kv.slice(CHUNK, 2 * CHUNK))
    check = _check(tiny_llama, kv)
    assert decode(blob, expect=check.expect).start == CHUNK  # the planned chunk 1 passes
    model = kv.model
    # 2**24 elements per token, a thousand times the tokens, another chunk, another model's
    # layers: each would size an output the plan never asked for.
    for fields, reason in (
        ({"layers": 256, "heads": 256, "head_dim": 256}, "KV geometry"),
        ({"tokens": 1000 * CHUNK}, "tokens from position"),
        ({"start": 7 * CHUNK}, "not a planned chunk"),
        ({"heads": model.num_kv_heads * 2}, "KV geometry"),
    ):
        forged = forged_header(blob, **fields)
        with pytest.raises(CodecError, match="truncated"):
            decode(forged)  # what reading on from the header finds: no frames
        with pytest.raises(ConnectorError, match=f"{reason}.*refused before decoding"):
            decode(forged, expect=check.expect)


def test_a_forged_record_in_the_store_is_refused_and_dropped(tiny_llama, kv, tmp_path):
    transport = connector_transport(tiny_llama, tmp_path, save_modes=["raw"])
    try:
        ids = kv.token_ids.tolist()
        assert transport.save(ids, kv, ["raw"]) > 0
        address = RecordAddress.of(transport.keys("raw", ids)[1], Form("raw"))
        stored = transport.store.read(address)
        transport.store.write(address, forged_header(stored, layers=256, heads=256, head_dim=256))
        result = transport.load(ids, 0, 2, RequestOptions(mode="raw"), [].append)
        assert result.chunks_loaded == 1
        assert "KV geometry" in result.error and "refused before decoding" in result.error
        assert transport.store.holds([address]) == [False]  # dropped, so a save stores it anew
    finally:
        transport.close()
