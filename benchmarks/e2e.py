"""End to end through vLLM: TTFT, latency and throughput for every mode (from the sweep)."""

from .common import BANDWIDTHS, CONTEXTS, KV_MODES, MODELS, MODES, median_row, sweep, value


class EndToEnd:
    """One request after a stored context: text recompute, or the context's KV loaded over a
    link of the given bandwidth by the CacheGenConnector. Recompute ignores the bandwidth."""

    params = (MODELS, MODES, BANDWIDTHS, CONTEXTS)
    param_names = ("model", "mode", "bandwidth_mbps", "context_tokens")
    setup_cache = staticmethod(sweep)
    rounds = 1  # the numbers come from the sweep; re-reading them adds nothing

    def setup(self, path, model, mode, bandwidth, context):
        self.row = median_row(path, "e2e", model, mode, bandwidth, context)

    def track_ttft(self, path, model, mode, bandwidth, context):
        return value(self.row, "ttft_s")

    track_ttft.unit = "seconds"

    def track_e2e_latency(self, path, model, mode, bandwidth, context):
        return value(self.row, "e2e_s")

    track_e2e_latency.unit = "seconds"

    def track_output_tokens_per_s(self, path, model, mode, bandwidth, context):
        return value(self.row, "output_tokens_per_s")

    track_output_tokens_per_s.unit = "tokens/s"


class ConnectorLoad:
    """What the connector reported for loading the context's KV inside vLLM."""

    params = (MODELS, KV_MODES, BANDWIDTHS, CONTEXTS)
    param_names = ("model", "mode", "bandwidth_mbps", "context_tokens")
    setup_cache = staticmethod(sweep)
    rounds = 1

    def setup(self, path, model, mode, bandwidth, context):
        self.row = median_row(path, "e2e", model, mode, bandwidth, context)

    def track_kv_bytes(self, path, model, mode, bandwidth, context):
        return value(self.row, "bytes")

    track_kv_bytes.unit = "bytes"

    def track_load_time(self, path, model, mode, bandwidth, context):
        return value(self.row, "load_s")

    track_load_time.unit = "seconds"

    def track_inject_time(self, path, model, mode, bandwidth, context):
        return value(self.row, "inject_s")

    track_inject_time.unit = "seconds"
