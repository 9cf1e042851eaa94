"""Transform coding with entropy-coded uniform quantizers: the ``tcq`` codec.

Per layer, keys (turned back to their pre-RoPE form) and values each go through a PCA basis
over all heads' channels together, like ``kvtc``; unlike ``kvtc``, every component is coded by
a *uniform* quantizer whose symbols go through the project's rANS coder
(:mod:`cachegen.codec.coding.rans`) with one calibrated frequency table per component. Component
``i`` of a (layer, K/V) has the step ``step / sqrt(w_i)``, where ``w_i`` is its weight in an
output-tracking distortion (keys: the component's mean squared effect on the attention logits
of the queries that read it; values: its gain through the output projection), so a level is
one step for the keys and one for the values: reverse water-filling. A component whose
calibration coefficients stay within a fraction of its step is dropped (costs nothing); the
others get an alphabet ``[-r_i, r_i]`` (``r_i`` from the calibration range, values beyond are
clipped) and a frequency table from the calibration histogram.

Text unlike the calibration text shifts the components' means and widens or narrows their
spreads, and calibrated tables then cost more than the symbols' entropy. So each frame also
chooses, per kept component, an *offset* (the median of its coefficients in quarter steps:
the quantizer's grid moves with it) and a *table*: the calibrated one or one of a fixed
family of discretized generalized-Gaussian shapes (``family`` in the model file), whichever
codes the frame's symbols in the fewest bits. The choices travel DEFLATE-compressed.

Everything the decoder shares with the encoder (basis, weights, steps, radii, tables) is one
file, a :class:`TcqModel` (``profiles/transforms/<id>.cgtq``; built from the model only by
``cachegen.fitting.tcq.ensure_tcq_model``), named by its content hash in the bitstream's
header (16 bytes; a 17th byte, the frame layout: ``ADAPTIVE_LAYOUT`` marks frames with
choices, format version 5; ``PREDICTED_LAYOUT`` frames whose layers' first components are
coded as residuals of a prediction from the layer before, format version 6,
:mod:`cachegen.codec.tcq.predict`; bit ``REFINED`` coded frames whose attention sinks' rows
are refined a quarter step finer, format version 7, :mod:`cachegen.codec.tcq.refine`). Frame
body::

    exact      tokens at positions below EXACT_TOKENS: keys then values [L, H, e, D] in the
               KV's dtype (empty in most frames)
    choices    (adaptive frames only) u32 byte count, then DEFLATE (zlib) of: every stream's
               kept components' offsets (i8, quarter steps), then their tables (u8: 0 the
               calibrated table, 1 + j family shape j), streams ordered (layer, K/V); no
               bytes at all when the frame has no token past the exact ones
    refinement (refined frames only) u32 byte count, then the refined rows and their
               refinement symbols (:mod:`cachegen.codec.tcq.refine`); no bytes at all when
               the frame has no token past the exact ones
    directory  u32 word count of each rANS stream, streams ordered (layer, K/V)
    streams    little-endian u16 words (layout in rans.py): stream (l, K/V) codes the symbols
               [kept components, tokens - e] of its kept components (a stream with no kept
               component or no token has no words)

A model file without a family (format version 1, written before the choices) encodes and
decodes frames without them; one without a predictor (version 2) frames without predictions.
The packed form (:mod:`cachegen.codec.tcq.packed`) holds the same symbols bit-packed, never
predicted nor refined.
"""

from __future__ import annotations

from cachegen import models
from cachegen.codec.base import FrameDecoder, ModelCodec
from cachegen.codec.coding.bitstream import Header
from cachegen.codec.errors import CodecError
from cachegen.codec.tcq.code import level_code
from cachegen.codec.tcq.decode import TcqDecoder
from cachegen.codec.tcq.encode import encode_body
from cachegen.codec.tcq.levels import read_tcq_levels
from cachegen.codec.tcq.model import TcqModel, find_tcq_model, load_tcq_model
from cachegen.codec.tcq.packed import TcqPackedDecoder, encode_packed_body
from cachegen.codec.tcq.size import estimated_bits
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache
from cachegen.modes import CODED, FORMS, PACKED

MODEL_ID_BYTES = 16
# The header parameters' 17th byte, the frame layout: bit 0, frames carry per-component
# choices (format version 5); bit 1, their predicted layers code residuals (version 6).
ADAPTIVE_LAYOUT = 1
PREDICTED_LAYOUT = 3
REFINED = 4  # bit 2: coded frames carry refined rows (format version 7)
ADAPTIVE_BITSTREAM_VERSION = 5
PREDICTED_BITSTREAM_VERSION = 6
REFINED_BITSTREAM_VERSION = 7


class TcqCodec(ModelCodec):
    name = "tcq"
    codec_id = 12
    fitted_kind = "basis"
    forms = FORMS

    def __init__(
        self,
        model: models.ModelSpec | str | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        tcq: TcqModel | None = None,
        refine: bool = True,
    ) -> None:
        super().__init__(model, chunk_tokens, tcq)
        self.refine = refine  # coded frames refine their sinks' rows (:mod:`.tcq_refine`)

    load_fitted = staticmethod(load_tcq_model)

    @property
    def tcq(self) -> TcqModel:
        return self.fitted

    def calibrated_levels(self) -> dict | None:
        """The quality targets its levels met and the default level, as ``cachegen calibrate
        --codec tcq`` chose them for this model file or shipped them for its recipe
        (``cachegen.codec.tcq.levels``); None if never calibrated."""
        return read_tcq_levels(self.tcq.model, self.tcq.id, self.tcq.calibration)

    @property
    def default_level(self) -> int:
        """The calibrated default level (:meth:`calibrated_levels`), else the middle one."""
        calibrated = self.calibrated_levels()
        if calibrated and calibrated["default_level"] is not None:
            return calibrated["default_level"]
        return self.levels[len(self.levels) // 2]

    def estimated_bits(self, level: int, chunk_tokens: int, form: str = CODED) -> float:
        """Bits/element of ``level`` in ``form`` for a chunk of ``chunk_tokens`` tokens, from
        the model file alone (``cachegen.codec.tcq.size``): the same on every engine."""
        return estimated_bits(self.tcq, level, chunk_tokens, form)

    def encode(self, kv: KVCache, level: int | None = None, form: str = CODED) -> bytes:
        """``form`` "coded" rANS-codes the symbols (smallest), "packed" stores them bit-packed
        (larger, decodes faster to the same KV; :mod:`cachegen.codec.tcq.packed`)."""
        self.fit_for(kv)
        self.tcq.check_model(kv.model)
        return super().encode(kv, level, form)

    def header_params(self, kv: KVCache, level: int, form: str) -> tuple[bytes, int]:
        """The model file's id, then (a model file with a table family) the frame layout:
        choices, and in the coded form of a model file with a predictor, predicted layers."""
        model_id = bytes.fromhex(self.tcq.id)
        if not self.tcq.adaptive:
            return model_id, 1
        layout, version = ADAPTIVE_LAYOUT, ADAPTIVE_BITSTREAM_VERSION
        if self.tcq.predicted and form == CODED:
            layout, version = PREDICTED_LAYOUT, PREDICTED_BITSTREAM_VERSION
        if self._refines(form):
            layout, version = layout | REFINED, REFINED_BITSTREAM_VERSION
        return model_id + bytes([layout]), version

    def _refines(self, form: str) -> bool:
        return self.refine and self.tcq.adaptive and form == CODED

    def encode_body(self, chunk: KVCache, level: int) -> bytes:
        return encode_body(self.tcq, level_code(self.tcq, level), chunk, self._refines(CODED))

    def encode_packed_body(self, chunk: KVCache, level: int) -> bytes:
        return encode_packed_body(self.tcq, level_code(self.tcq, level), chunk)

    @classmethod
    def decoder(cls, header: Header) -> FrameDecoder:
        params = header.params
        if len(params) not in (MODEL_ID_BYTES, MODEL_ID_BYTES + 1):
            raise CodecError("tcq bitstream header is corrupt (parameters)")
        if len(params) > MODEL_ID_BYTES and not _layout_fits(params[-1], header):
            raise CodecError("tcq bitstream header is corrupt (frame layout)")
        return decoder_with(header, find_tcq_model(params[:MODEL_ID_BYTES].hex(), header.model))


def decoder_with(header: Header, tcq: TcqModel) -> FrameDecoder:
    """The decoder of a stream whose header names ``tcq`` (already found, or held in memory by
    a lab), its frame layout checked against the model file."""
    params = header.params
    adaptive = len(params) == MODEL_ID_BYTES + 1
    predicted = adaptive and params[-1] & ~REFINED == PREDICTED_LAYOUT
    refined = adaptive and bool(params[-1] & REFINED)
    if adaptive and not tcq.adaptive:
        raise CodecError(
            f"tcq bitstream is corrupt: its frames choose tables, but its model file "
            f"{tcq.id[:16]} has no table family"
        )
    if predicted and not tcq.predicted:
        raise CodecError(
            f"tcq bitstream is corrupt: its frames are predicted, but its model file "
            f"{tcq.id[:16]} has no predictor"
        )
    code = level_code(tcq, header.level)
    if header.form == PACKED:
        return TcqPackedDecoder(header, tcq, code, adaptive)
    return TcqDecoder(header, tcq, code, adaptive, predicted, refined)


def _layout_fits(layout: int, header: Header) -> bool:
    """Whether a frame layout byte is one this reader knows, in a stream of a version (and
    form: the packed form never predicts nor refines) that holds it."""
    if layout & REFINED and (header.version < REFINED_BITSTREAM_VERSION or header.form != CODED):
        return False
    layout &= ~REFINED
    if layout == ADAPTIVE_LAYOUT:
        return header.version >= ADAPTIVE_BITSTREAM_VERSION
    return (
        layout == PREDICTED_LAYOUT
        and header.version >= PREDICTED_BITSTREAM_VERSION
        and header.form == CODED
    )
