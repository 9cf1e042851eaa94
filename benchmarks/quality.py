"""Answer quality with decoded KV instead of the original (from the sweep)."""

from .common import CODEC_MODES, MODELS, quality_row, sweep, value


class Quality:
    params = (MODELS, CODEC_MODES)
    param_names = ("model", "mode")
    setup_cache = staticmethod(sweep)
    rounds = 1

    def setup(self, path, model, mode):
        self.row = quality_row(path, model, mode)

    def track_perplexity_change(self, path, model, mode):
        return value(self.row, "ppl_change_pct")

    track_perplexity_change.unit = "percent"

    def track_top1_agreement(self, path, model, mode):
        return value(self.row, "top1_agreement")

    track_top1_agreement.unit = "fraction"
