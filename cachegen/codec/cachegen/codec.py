"""The CacheGen codec: layer-wise quantization, optional token locality, per-channel rANS.

Per frame (``chunk_tokens`` tokens) the keys and values are quantized with the level's
:class:`~cachegen.codec.cachegen.quant.QuantConfig` into symbol *segments* (all tokens, or anchors
and deltas when token locality is on); every (layer, K/V, segment) becomes one rANS stream
coded with the profile's per-channel tables. Frame body::

    exact      the frame's exactly stored tokens (positions below the level's ``exact_tokens``):
               keys then values [L, H, e, D] in the KV's dtype; empty in most frames
    scales     fp16, for K then V, for each segment: [L, n] (token), [L, H, n] (token-head)
               or [L, H, D] (channel)
    directory  u32 word count of each stream, streams ordered (layer, K/V, segment)
    streams    the rANS streams, little-endian u16 words (layout in rans.py)

The header's codec parameters are the 16-byte tables id followed by the packed config, so
the decoder needs nothing but the bitstream and (the tables, or the model to rebuild them).

A stream of a layer subset (``KVCache.layers``) holds those layers only (``L`` above is the
number present); every per-layer setting (bins, rotary base, table rows) is the one of the
layer's absolute index, so a subset decodes to exactly the values of the same layers of a
full stream: every scale, symbol and rANS stream belongs to one layer.

Encoding is ``cachegen_encode.py``, decoding ``cachegen_decode.py``.

The *packed form* (``encode(kv, level, form="packed")``, header flag bit 3) stores the same
exact tokens and scales, then one width byte per stream and the streams' symbols bit-packed
at that width (``packed.py``) instead of the directory and the rANS streams. It decodes to the
same KV, bit for bit, at memory speed, and needs no probability tables.
"""

from __future__ import annotations

from cachegen import models
from cachegen.codec.base import FrameDecoder, ModelCodec
from cachegen.codec.cachegen.decode import CacheGenDecoder, PackedDecoder
from cachegen.codec.cachegen.encode import encode_chunk, encode_packed_chunk
from cachegen.codec.cachegen.profile import Profile, load_profile
from cachegen.codec.cachegen.quant import QuantConfig
from cachegen.codec.cachegen.size import coded_bits, packed_bits
from cachegen.codec.coding.bitstream import Header
from cachegen.codec.coding.tables import find_tables
from cachegen.codec.errors import CodecError
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache
from cachegen.modes import CODED, FORMS, PACKED

TABLES_ID_BYTES = 16


class CacheGenCodec(ModelCodec):
    name = "cachegen"
    codec_id = 6
    fitted_kind = "profile"
    forms = FORMS

    def __init__(
        self,
        model: models.ModelSpec | str | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        profile: Profile | None = None,
    ) -> None:
        super().__init__(model, chunk_tokens, profile)

    load_fitted = staticmethod(load_profile)

    @property
    def profile(self) -> Profile:
        return self.fitted

    @property
    def default_level(self) -> int:
        return self.profile.default_level

    def estimated_bits(self, level: int, chunk_tokens: int, form: str = CODED) -> float:
        """Bits/element of ``level`` in ``form`` for a chunk of ``chunk_tokens`` tokens, from
        the profile alone (``cachegen.codec.cachegen.size``): the same on every engine."""
        if form == CODED:
            return coded_bits(self.profile.tables(level), chunk_tokens)
        model = self.profile.model
        return packed_bits(
            self.profile.config(level), model.num_kv_heads, model.head_dim, chunk_tokens
        )

    def encode(self, kv: KVCache, level: int | None = None, form: str = CODED) -> bytes:
        """``form`` "coded" entropy-codes the symbols (smallest), "packed" stores them
        bit-packed (larger, decodes at memory speed to the same KV)."""
        self.fit_for(kv)
        if kv.model.fingerprint != self.profile.model.fingerprint:
            raise CodecError(
                f"KV of model {kv.model.name} cannot use the profile of {self.profile.model.name}"
            )
        return super().encode(kv, level, form)

    def encode_packed_body(self, chunk: KVCache, level: int) -> bytes:
        return encode_packed_chunk(chunk, self.profile.config(level))

    def params(self, kv: KVCache, level: int) -> bytes:
        tables = self.profile.tables(level)
        return bytes.fromhex(tables.id) + tables.config.pack()

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        tables = self.profile.tables(level)
        return encode_chunk(chunk, tables)

    def bitstream_version(self, level: int) -> int:
        return self.profile.config(level).bitstream_version

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        params = header.params
        if len(params) <= TABLES_ID_BYTES:
            raise CodecError("cachegen bitstream header is corrupt (parameters)")
        config = QuantConfig.unpack(params[TABLES_ID_BYTES:])
        if config.bitstream_version > header.version:
            raise CodecError(
                f"cachegen bitstream header is corrupt (per-layer rotary bases in a format "
                f"version {header.version} stream)"
            )
        config.check_geometry(header.model.num_layers, header.head_dim)
        tables_id = params[:TABLES_ID_BYTES].hex()
        if header.form == PACKED:
            return PackedDecoder(header, config, tables_id)
        tables = find_tables(tables_id, config, header.model)
        m = tables.model
        if (m.num_layers, m.num_kv_heads, m.head_dim) != (
            header.model.num_layers,
            header.num_kv_heads,
            header.head_dim,
        ):
            raise CodecError("cachegen bitstream geometry does not match its profile tables")
        return CacheGenDecoder(header, tables)
