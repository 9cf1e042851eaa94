"""Compression and streaming without vLLM: sizes, ratios, transfer and decode time (from the
sweep)."""

from .common import BANDWIDTHS, CODEC_MODES, CONTEXTS, MODELS, median_row, sweep, value


class Compression:
    """Bytes of the whole context's KV per codec (headers, tables, scales counted)."""

    params = (MODELS, CODEC_MODES, CONTEXTS)
    param_names = ("model", "mode", "context_tokens")
    setup_cache = staticmethod(sweep)
    rounds = 1

    def setup(self, path, model, mode, context):
        self.row = median_row(path, "stream", model, mode, None, context)

    def track_ratio_vs_fp16(self, path, model, mode, context):
        return value(self.row, "ratio_vs_fp16")

    track_ratio_vs_fp16.unit = "x (fp16 bytes / bytes)"

    def track_ratio_vs_int8(self, path, model, mode, context):
        return value(self.row, "ratio_vs_int8")

    track_ratio_vs_int8.unit = "x (int8 per-token bytes / bytes)"

    def track_bits_per_element(self, path, model, mode, context):
        return value(self.row, "bits_per_element")

    track_bits_per_element.unit = "bits/element"

    def track_encode_time(self, path, model, mode, context):
        return value(self.row, "encode_s")

    track_encode_time.unit = "seconds"


class Streaming:
    """Loading the encoded context over a real loopback socket at the given rate, decoding
    pipelined with the transfer."""

    params = (MODELS, CODEC_MODES, BANDWIDTHS, CONTEXTS)
    param_names = ("model", "mode", "bandwidth_mbps", "context_tokens")
    setup_cache = staticmethod(sweep)
    rounds = 1

    def setup(self, path, model, mode, bandwidth, context):
        self.row = median_row(path, "stream", model, mode, bandwidth, context)

    def track_transfer_time(self, path, model, mode, bandwidth, context):
        return value(self.row, "transfer_s")

    track_transfer_time.unit = "seconds"

    def track_decode_time(self, path, model, mode, bandwidth, context):
        return value(self.row, "decode_s")

    track_decode_time.unit = "seconds"

    def track_load_time(self, path, model, mode, bandwidth, context):
        return value(self.row, "load_s")

    track_load_time.unit = "seconds"

    def track_goodput(self, path, model, mode, bandwidth, context):
        return value(self.row, "goodput_mbps")

    track_goodput.unit = "Mbit/s"
