"""Codec speed, size and memory on real KV: encode, decode (entropy decode + dequantize) per codec.

The KV and the sizes come from the lab's codec measurements (``cachegen codec-report``).
"""

import os
import statistics
import time

from cachegen.codec import decode
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache
from cachegen.modes import Mode
from cachegen.profiles import codec_for
from cachegen_lab.bench.codec_report import measure, text_windows

from .common import CODEC_MODES, MODEL_MODES, MODELS, PROFILE, QUICK

CONTEXT_TOKENS = 512 if QUICK else 1024
KV_DIR = "codec-kv"


def extract_kv() -> str:
    """KV of ``CONTEXT_TOKENS`` tokens of held-out CPython documentation for each model, saved
    once into one directory per model."""
    for model in MODELS:
        (kv,) = text_windows(model, CONTEXT_TOKENS, 1)
        kv.save(os.path.join(KV_DIR, model.replace("/", "--")))
    return os.path.abspath(KV_DIR)


extract_kv.timeout = 600


class CodecSpeed:
    """Whole-context encode and decode of ``CONTEXT_TOKENS`` tokens of each model's KV, for
    the codec modes the sweep measures of that model."""

    params = (MODELS, CODEC_MODES)
    param_names = ("model", "mode")
    setup_cache = staticmethod(extract_kv)
    number = 1
    repeat = (1, 3, 5.0) if QUICK else (3, 10, 20.0)  # (min samples, max samples, seconds budget)
    rounds = 1
    warmup_time = 0

    def setup(self, kv_dir, model, mode):
        if mode not in MODEL_MODES[model]:
            raise NotImplementedError(
                f"{mode} is not one of {model}'s modes in the {PROFILE} profile"
            )
        parsed = Mode.parse(mode)
        self.kv = KVCache.load(os.path.join(kv_dir, model.replace("/", "--")))
        self.codec = codec_for(parsed.codec_name, model)
        if parsed.level is not None and parsed.level not in self.codec.levels:
            raise NotImplementedError(f"{model}'s codec profile has no level {parsed.level}")
        self.level = self.codec.resolve_level(parsed.level)
        self.blob = self.codec.encode(self.kv, level=self.level)
        decode(self.blob)  # tables and kernels loaded before timing

    def time_encode(self, kv_dir, model, mode):
        self.codec.encode(self.kv, level=self.level)

    def time_decode(self, kv_dir, model, mode):
        decode(self.blob)

    def peakmem_decode(self, kv_dir, model, mode):
        decode(self.blob)

    def track_decode_rate(self, kv_dir, model, mode):
        """KV elements decoded per second, median of five whole-context decodes."""
        times = []
        for _ in range(5):
            begin = time.perf_counter()
            decode(self.blob)
            times.append(time.perf_counter() - begin)
        return self.kv.num_elements / statistics.median(times) / 1e6

    track_decode_rate.unit = "M elements/s"

    def track_bits_per_element(self, kv_dir, model, mode):
        """Bits per KV element, one bitstream per chunk as the store holds them."""
        return measure(self.codec, self.level, [self.kv], CHUNK_TOKENS)["bits_per_element"]

    track_bits_per_element.unit = "bits/element"
