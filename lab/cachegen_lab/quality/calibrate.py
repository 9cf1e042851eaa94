"""Calibrated quality levels: the fewest bits that meet a quality target.

The paper hand-tuned its bins per layer. Here they are chosen per model from measurements
on the ``calibrate`` split of the pydoc text (never used for evaluation, never the codec
profile's text):

1. **Sensitivity.** For every group of consecutive layers and K/V, the model runs with only
   those keys or values quantized by a reference quantizer; the KL divergence of the next-token
   distributions per unit of squared error is that group's sensitivity.
2. **Statistics.** For every option (Hadamard rotation, scale granularity for keys and for
   values; keys turned back by their rotary angles and the first token stored exactly in all
   of them unless the settings say otherwise) and every bin count of a ladder, the codec's own
   quantizer gives each group's squared error and estimated bits (symbol entropy + scales),
   without any model run.
3. **Allocation.** With KL modelled as sensitivity x squared error and additive over groups,
   a Lagrangian trade-off ``bits + lambda * KL`` picks per-layer bins for each option
   family. The probes measured one kind of noise, and other families' noise hurts more or
   less per unit of squared error, so one allocation per family is run for real near the
   target and that family's predictions are rescaled by measured / predicted KL. Then the
   trade-off picks family and bins for a range of ``lambda``, both per layer and with one
   bin count for all keys and one for all values (less reliant on the per-group model).
4. **Verification.** Every distinct allocation runs for real on the calibration windows.
   (Calibration runs the model in float32, see ``CalibrationSettings.dtype``.)
   Perplexity change is regressed on measured KL (far less noisy per token), which turns
   the perplexity target into a KL budget; the allocation with the fewest bits within it
   wins.

The result is a :class:`~cachegen.codec.QuantConfig` saved as a level of the model's codec
profile (:func:`cachegen.profiles.add_level`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from cachegen import models
from cachegen.codec import SCALE_KINDS, QuantConfig
from cachegen.constants import CHUNK_TOKENS
from cachegen.errors import InputError
from cachegen.fileio import check_version, versioned
from cachegen.fitting.replay import continuation_logits
from cachegen.kv import KVCache
from cachegen_lab.quality.candidates import config_codec
from cachegen_lab.quality.datasets import pydoc_windows
from cachegen_lab.quality.metrics import Reference, compare_logits
from cachegen_lab.quality.simulate import KINDS, quantize_kind, quantize_kv

LADDER = (4, 6, 8, 12, 16, 24, 32, 48, 64)
PROBE_BINS = (
    16  # reference quantizer of the sensitivity probes: Hadamard, per token-and-head scales
)
KL_PER_PPL_PCT = (
    0.01  # rough exchange rate (nats/token per % perplexity) for aiming the option probes
)
SCHEMA = "cachegen-calibration"  # calibration.json
VERSION = 1
CALIBRATION_LEVEL = 0xFFFE  # level number of the in-memory codec that measures the chosen config
LAMBDAS = tuple(10 ** (e / 4) for e in range(-4, 25))  # 0.1 .. 1e6, four per decade


@dataclass
class CalibrationSettings:
    targets: tuple[float, ...] = (
        1.0,
    )  # quality targets: |perplexity change| at most this (percent)
    margin: float = 0.8  # aim at margin x target on the calibration windows
    windows: int = 8
    stats_windows: int = 4  # windows whose KV statistics (errors, bits) drive the allocation
    context_tokens: int = 1024
    continuation_tokens: int = 64
    probe_groups: int = (
        10  # sensitivity is measured per run of consecutive layers (30 layers: 3 each)
    )
    ladder: tuple[int, ...] = LADDER
    hadamard: tuple[bool, ...] = (False, True)
    scales: tuple[str, ...] = SCALE_KINDS
    chunk_tokens: int = CHUNK_TOKENS  # the codec's chunk size (per-chunk scales depend on it)
    # Options every allocation gets (see cachegen.codec.cachegen.quant): turn keys back by the
    # model's rotary angles (when it has RoPE) and store the first tokens exactly.
    derotate_keys: bool = True
    exact_tokens: int = 1
    # How a target picks among the verified allocations (the cheapest one that passes):
    # "kl": KL within the budget the perplexity target maps to (regression over all trials)
    # and perplexity within the target; "ppl": measured perplexity change within margin x target.
    select: str = "kl"
    seed: int = 0
    # Calibration runs the model in float32: in bf16 *any* change to the KV, however small,
    # decorrelates the rounding of the whole forward pass and costs a floor of KL (about
    # what int8 shows) that would drown the per-group probes.
    dtype: torch.dtype = torch.float32


@dataclass
class Trial:
    """One verified allocation."""

    config: QuantConfig
    est_bits_per_element: float
    predicted_kl: float
    kl: float = math.nan
    ppl_change_pct: float = math.nan
    top1_agreement: float = math.nan

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "est_bits_per_element": self.est_bits_per_element,
            "predicted_kl": self.predicted_kl,
            "kl": self.kl,
            "ppl_change_pct": self.ppl_change_pct,
            "top1_agreement": self.top1_agreement,
        }


@dataclass
class Choice:
    """The allocation picked for one target."""

    target_ppl_pct: float
    trial: Trial
    config: QuantConfig  # the trial's config, described
    kl_budget: float | None  # None when the choice was made on perplexity alone
    ppl_per_kl: float
    codec_bits_per_element: float

    def to_dict(self) -> dict:
        return {
            "target_ppl_pct": self.target_ppl_pct,
            "kl_budget": self.kl_budget,
            "ppl_pct_per_kl": self.ppl_per_kl,
            "codec_bits_per_element": self.codec_bits_per_element,
            **self.trial.to_dict(),
            "config": self.config.to_dict(),
        }


@dataclass
class CalibrationResult:
    model: dict  # name and fingerprint of the calibrated model
    choices: list[Choice]
    trials: list[Trial]
    sensitivity: dict[str, list[float]]
    settings: CalibrationSettings

    def to_dict(self) -> dict:
        s = self.settings
        return versioned(
            SCHEMA,
            VERSION,
            {
                "model": self.model,
                "margin": s.margin,
                "windows": s.windows,
                "context_tokens": s.context_tokens,
                "continuation_tokens": s.continuation_tokens,
                "probe_groups": s.probe_groups,
                "seed": s.seed,
                "select": s.select,
                "derotate_keys": s.derotate_keys,
                "exact_tokens": s.exact_tokens,
                "dtype": str(s.dtype).removeprefix("torch."),
                "split": "calibrate",
                "choices": [c.to_dict() for c in self.choices],
                "sensitivity_kl_per_mse": self.sensitivity,
                "trials": [t.to_dict() for t in self.trials],
            },
        )


class CalibrationWindows:
    """Calibration windows with their original KV and reference scores, kept in memory."""

    def __init__(self, model: str, settings: CalibrationSettings, progress: bool) -> None:
        from cachegen.extract import extract_kv, load_model

        self.hf_model, tokenizer, self.spec = load_model(model, settings.dtype)
        self.settings = settings
        self.progress = progress
        windows = pydoc_windows(
            tokenizer,
            count=settings.windows,
            context_tokens=settings.context_tokens,
            continuation_tokens=settings.continuation_tokens,
            seed=settings.seed,
            split="calibrate",
        )
        self.items: list[tuple[KVCache, torch.Tensor, Reference]] = []
        for w in tqdm(
            windows, desc="calibration windows", unit="window", disable=not progress, leave=False
        ):
            kv = extract_kv(model, token_ids=w.context_ids, dtype=settings.dtype)
            logits = continuation_logits(self.hf_model, [kv], w.continuation_ids)[0, :-1]
            self.items.append(
                (kv, w.continuation_ids, Reference.of(logits, w.continuation_ids[1:]))
            )

    def score(self, variants, desc: str) -> list[tuple[float, float, float]]:
        """(KL per token, perplexity change %, top-1 agreement) of each variant over all windows.

        ``variants`` is a list of functions ``(window index, kv) -> decoded kv``.
        """
        totals = [[0.0, 0.0, 0.0, 0.0, 0.0] for _ in variants]
        bar = tqdm(
            total=len(self.items) * len(variants),
            desc=desc,
            unit="run",
            disable=not self.progress,
            leave=False,
        )
        for n, (kv, continuation, ref) in enumerate(self.items):
            for variant, t in zip(variants, totals):
                # alone, as the reference ran: a batch's size changes the rounding of oneDNN's
                # bf16 kernels on CPUs with AMX (cachegen_lab.quality.evaluate)
                logits = continuation_logits(self.hf_model, [variant(n, kv)], continuation)
                s = compare_logits(ref, logits[0, :-1])
                t[0] += s.tokens
                t[1] += s.kl
                t[2] += s.nll
                t[3] += s.nll_original
                t[4] += s.agree
                bar.update()
        bar.close()
        return [
            (t[1] / t[0], 100.0 * math.expm1((t[2] - t[3]) / t[0]), t[4] / t[0]) for t in totals
        ]


def _replace_layers(kv: KVCache, kind: str, layers: list[int], data: torch.Tensor) -> KVCache:
    """``kv`` with the keys or values of ``layers`` taken from ``data`` ([L, H, T, D])."""
    keys, values = kv.keys, kv.values
    if kind == "k":
        keys = keys.clone()
        keys[layers] = data[layers].to(keys.dtype)
    else:
        values = values.clone()
        values[layers] = data[layers].to(values.dtype)
    return KVCache(keys, values, kv.token_ids, kv.model, kv.start)


def _layer_groups(layers: int, groups: int) -> list[list[int]]:
    """``groups`` runs of consecutive layers, as even as possible (at most one per layer)."""
    count = max(1, min(groups, layers))
    bounds = [round(i * layers / count) for i in range(count + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def _fixed_options(spec, settings: CalibrationSettings) -> dict:
    """The QuantConfig options every allocation of this calibration shares."""
    thetas = models.rope_thetas(spec.config) if settings.derotate_keys else (0.0,)
    # one number when every layer shares its base (as QuantConfig writes it), else a list
    theta = thetas[0] if len(set(thetas)) == 1 else list(thetas)
    return {"rope_theta": theta, "exact_tokens": settings.exact_tokens}


def _mse_per_layer(kv: KVCache, kind: str, decoded: torch.Tensor) -> torch.Tensor:
    x = (kv.keys if kind == "k" else kv.values).to(torch.float32)
    return (decoded - x).pow(2).mean(dim=(1, 2, 3))


class _Model:
    """Per-group error and bits tables plus sensitivities: predicts KL and bits of a config."""

    def __init__(self, data: CalibrationWindows, settings: CalibrationSettings) -> None:
        self.settings = settings
        first = data.items[0][0]
        self.layers = first.num_layers
        self.fixed = _fixed_options(data.spec, settings)
        probe = self._uniform(PROBE_BINS, "token-head", "token-head", True)
        chunk = settings.chunk_tokens
        # 1. sensitivity: KL per unit of squared error, one probe run per (kind, layer group);
        #    every layer of a group gets the group's sensitivity.
        groups = _layer_groups(self.layers, settings.probe_groups)
        probe_mse = {kind: torch.zeros(self.layers, dtype=torch.float64) for kind in KINDS}
        quantized: list[dict[str, torch.Tensor]] = []
        for kv, _, _ in data.items:
            quantized.append({})
            for kind in KINDS:
                q, _ = quantize_kind(kv, probe, kind, chunk, count_bits=False)
                probe_mse[kind] += _mse_per_layer(kv, kind, q).double() / len(data.items)
                quantized[-1][kind] = q.to(kv.dtype)
        variants = [
            (
                lambda n, kv, kind=kind, layers=layers: _replace_layers(
                    kv, kind, layers, quantized[n][kind]
                )
            )
            for kind in KINDS
            for layers in groups
        ]
        scores = data.score(variants, "sensitivity probes")
        quantized.clear()  # the probes' KV copies are not needed past this point
        self.sensitivity = {kind: torch.zeros(self.layers, dtype=torch.float64) for kind in KINDS}
        for (kl, _, _), (kind, layers) in zip(
            scores, [(kind, layers) for kind in KINDS for layers in groups]
        ):
            mse = float(probe_mse[kind][layers].sum())
            self.sensitivity[kind][layers] = kl / max(mse, 1e-30)
        self.correction: dict[tuple[bool, str, str], float] = {}
        # 2. statistics: squared error and bits per element of every (option, bins, kind, layer)
        stats_items = data.items[: max(1, settings.stats_windows)]
        elements = sum(kv.num_elements for kv, _, _ in stats_items)
        self.mse: dict[tuple, torch.Tensor] = {}
        self.bits: dict[tuple, torch.Tensor] = {}
        combos = [
            (h, s, b) for h in settings.hadamard for s in settings.scales for b in settings.ladder
        ]
        bar = tqdm(
            total=len(combos) * 2,
            desc="quantizer statistics",
            unit="config",
            disable=not data.progress,
            leave=False,
        )
        for h, s, b in combos:
            config = self._uniform(b, s, s, h)
            for kind in KINDS:
                mse = torch.zeros(self.layers, dtype=torch.float64)
                bits = torch.zeros(self.layers, dtype=torch.float64)
                for kv, _, _ in stats_items:
                    q, layer_bits = quantize_kind(kv, config, kind, chunk)
                    mse += _mse_per_layer(kv, kind, q).double() / len(stats_items)
                    bits += layer_bits.double()
                self.mse[(h, kind, s, b)] = mse
                self.bits[(h, kind, s, b)] = bits / elements  # contribution to bits/element
                bar.update()
        bar.close()

    def _uniform(self, bins: int, key_scale: str, value_scale: str, hadamard: bool) -> QuantConfig:
        return QuantConfig(
            (bins,) * self.layers,
            (bins,) * self.layers,
            key_scale,
            value_scale,
            hadamard,
            **self.fixed,
        )

    def families(self) -> list[tuple[bool, str, str]]:
        """Option families: (Hadamard rotation, key scale granularity, value scale granularity)."""
        s = self.settings
        return [(h, ks, vs) for h in s.hadamard for ks in s.scales for vs in s.scales]

    def allocate_family(
        self, family: tuple[bool, str, str], lam: float, *, per_layer: bool = True
    ) -> tuple[QuantConfig, float, float]:
        """Bins of one family minimizing ``bits + lam * predicted KL``: (config, bits, KL).

        ``per_layer=False`` gives every layer of keys (and of values) the same bins, which
        leans less on the per-group sensitivities (verification decides which is better).
        """
        h, key_scale, value_scale = family
        c = self.correction.get(family, 1.0)
        ladder = self.settings.ladder
        bins, bits, kl = {}, 0.0, 0.0
        for kind, scale in (("k", key_scale), ("v", value_scale)):
            b_rows = torch.stack(
                [self.bits[(h, kind, scale, b)] for b in ladder]
            )  # [rungs, layers]
            k_rows = torch.stack(
                [self.sensitivity[kind] * self.mse[(h, kind, scale, b)] for b in ladder]
            )
            cost = b_rows + lam * c * k_rows
            if per_layer:
                pick = cost.argmin(dim=0, keepdim=True)
            else:
                pick = cost.sum(dim=1).argmin().view(1, 1).expand(1, cost.shape[1])
            bins[kind] = tuple(ladder[int(i)] for i in pick[0])
            bits += float(b_rows.gather(0, pick).sum())
            kl += c * float(k_rows.gather(0, pick).sum())
        return QuantConfig(bins["k"], bins["v"], key_scale, value_scale, h, **self.fixed), bits, kl

    def allocate(self, lam: float, *, per_layer: bool = True) -> tuple[QuantConfig, float, float]:
        """The family and bins minimizing ``bits + lam * predicted KL`` over all families."""
        options = (self.allocate_family(f, lam, per_layer=per_layer) for f in self.families())
        return min(options, key=lambda a: a[1] + lam * a[2])

    def lambda_for(self, family: tuple[bool, str, str], kl: float) -> float:
        """The trade-off whose allocation in ``family`` predicts a KL closest to ``kl``."""
        return min(
            LAMBDAS,
            key=lambda lam: abs(math.log(max(self.allocate_family(family, lam)[2], 1e-12) / kl)),
        )


def checked_settings(settings: CalibrationSettings | None) -> CalibrationSettings:
    """``settings`` (None: the defaults), refused when a target or the margin is out of range."""
    settings = settings or CalibrationSettings()
    if not settings.targets or min(settings.targets) <= 0:
        raise InputError("perplexity targets must be positive, e.g. 1.0 for 1%")
    if not 0 < settings.margin <= 1:
        raise InputError("the margin must be in (0, 1]")
    return settings


def calibrate(
    model: str, settings: CalibrationSettings | None = None, *, progress: bool = True
) -> CalibrationResult:
    """Find the cheapest options and per-layer bins that meet each of ``settings.targets``."""
    settings = checked_settings(settings)
    data = CalibrationWindows(model, settings, progress)
    predictor = _Model(data, settings)
    # How far off the KL model is differs between option families (the probes measured one
    # kind of noise): run one allocation per family near the target and correct its scale.
    probe_kl = KL_PER_PPL_PCT * settings.targets[0]
    families = predictor.families()
    first = [
        Trial(*predictor.allocate_family(f, predictor.lambda_for(f, probe_kl))) for f in families
    ]
    _verify(data, first, "option probes", settings)
    trials: dict[QuantConfig, Trial] = {}
    for family, trial in zip(families, first):
        predictor.correction[family] = max(trial.kl, 1e-12) / max(trial.predicted_kl, 1e-12)
        trials.setdefault(trial.config, trial)
    fresh: dict[QuantConfig, Trial] = {}
    for lam in LAMBDAS:
        for per_layer in (True, False):
            config, bits, kl = predictor.allocate(lam, per_layer=per_layer)
            if config not in trials:
                fresh.setdefault(config, Trial(config, bits, kl))
    _verify(data, list(fresh.values()), "verify allocations", settings)
    ordered = sorted([*trials.values(), *fresh.values()], key=lambda t: t.est_bits_per_element)
    choices = [_choose(data, ordered, target, settings) for target in settings.targets]
    sensitivity = {kind: [float(x) for x in predictor.sensitivity[kind]] for kind in KINDS}
    identity = data.spec.identity()
    model_info = {"name": identity.name, "fingerprint": identity.fingerprint}
    return CalibrationResult(model_info, choices, ordered, sensitivity, settings)


def _verify(
    data: CalibrationWindows, trials: list[Trial], desc: str, settings: CalibrationSettings
) -> None:
    """Measure KL, perplexity change and agreement of each trial on the calibration windows."""
    chunk = settings.chunk_tokens
    variants = [
        (lambda n, kv, c=t.config: quantize_kv(kv, c, chunk, count_bits=False)[0]) for t in trials
    ]
    for trial, (kl, ppl, agree) in zip(trials, data.score(variants, desc)):
        trial.kl, trial.ppl_change_pct, trial.top1_agreement = kl, ppl, agree


def within_target(trials, target: float, settings: CalibrationSettings, what: str):
    """``(ppl_pct_per_kl, kl_budget, passing)``: the measured ``trials`` (anything with ``kl``
    and ``ppl_change_pct``) that meet ``target`` by ``settings.select`` (module docs; the budget
    is None when selecting on perplexity alone). ``InputError`` naming ``what`` (e.g.
    ``allocation``) when none does."""
    slope = ppl_per_kl(trials, target)
    if settings.select == "ppl":
        budget = None
        within = [t for t in trials if abs(t.ppl_change_pct) <= settings.margin * target]
    else:
        budget = settings.margin * target / slope
        within = [t for t in trials if t.kl <= budget and abs(t.ppl_change_pct) <= target]
    if not within:
        raise InputError(
            f"no {what} kept the perplexity change within {target}% on the calibration windows "
            f"(best: {min(abs(t.ppl_change_pct) for t in trials):.2f}%); raise the target"
        )
    return slope, budget, within


def _choose(
    data: CalibrationWindows, trials: list[Trial], target: float, settings: CalibrationSettings
) -> Choice:
    slope, budget, within = within_target(trials, target, settings, "allocation")
    trial = min(within, key=lambda t: t.est_bits_per_element)
    config = replace(
        trial.config,
        description=(
            f"calibrated: perplexity change <= {target:g}% target, "
            f"est. {trial.est_bits_per_element:.2f} bits/element"
        ),
    )
    return Choice(target, trial, config, budget, slope, _codec_bits(data, config, settings))


def choose_again(
    model: str, path, settings: CalibrationSettings, *, progress: bool = True
) -> CalibrationResult:
    """Choose for ``settings.targets`` (with ``settings.select`` and ``margin``) among the
    allocations an earlier calibration verified (its ``calibration.json``), without measuring
    them again; the windows and sampling are the earlier run's."""
    document = _read_calibration(path, model)
    try:
        settings = replace(
            settings,
            windows=int(document["windows"]),
            context_tokens=int(document["context_tokens"]),
            continuation_tokens=int(document["continuation_tokens"]),
            probe_groups=int(document["probe_groups"]),
            seed=int(document.get("seed", 0)),
            derotate_keys=bool(document.get("derotate_keys", False)),
            exact_tokens=int(document.get("exact_tokens", 0)),
        )
        trials = [
            Trial(
                QuantConfig.from_dict(t["config"]),
                float(t["est_bits_per_element"]),
                float(t["predicted_kl"]),
                float(t["kl"]),
                float(t["ppl_change_pct"]),
                float(t["top1_agreement"]),
            )
            for t in document["trials"]
        ]
        sensitivity = {
            kind: [float(x) for x in document["sensitivity_kl_per_mse"][kind]] for kind in KINDS
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(f"{path} has a malformed entry: {exc!r}") from exc
    data = CalibrationWindows(model, settings, progress)
    choices = [_choose(data, trials, target, settings) for target in settings.targets]
    return CalibrationResult(document["model"], choices, trials, sensitivity, settings)


def _codec_bits(
    data: CalibrationWindows, config: QuantConfig, settings: CalibrationSettings
) -> float:
    """Bits/element of ``config`` through the real codec (tables, scales, headers: all of it)."""
    from cachegen.codec import inspect

    codec = config_codec(data.spec, config, CALIBRATION_LEVEL)
    bits = elements = 0.0
    for kv, _, _ in data.items[: max(1, settings.stats_windows)]:
        bits += (
            inspect(codec.encode(kv, level=CALIBRATION_LEVEL))["bits_per_element"] * kv.num_elements
        )
        elements += kv.num_elements
    return bits / elements


def save_level(model: str, config: QuantConfig, level: int, *, make_default: bool) -> dict:
    """Store a calibrated config as ``level`` of the model's codec profile."""
    from cachegen.profiles import add_level

    profile = add_level(model, level, config, make_default=make_default)
    return {"level": level, "profile": str(profile.path), "default": profile.default_level == level}


def _read_calibration(path, model: str) -> dict:
    """An earlier run's ``calibration.json``, checked to belong to ``model``."""
    import json

    from cachegen.models import resolve

    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read calibration {path}: {exc}") from exc
    check_version(document, SCHEMA, (VERSION,), str(path))
    fingerprint = resolve(model).identity().fingerprint
    if document.get("model", {}).get("fingerprint") != fingerprint:
        raise InputError(
            f"{path} was calibrated for {document.get('model', {}).get('name')!r}, "
            f"not for {model!r} "
            f"(weights differ); calibrate this model instead"
        )
    return document


def load_choices(path, model: str) -> list[QuantConfig]:
    """The chosen configs of a saved calibration (``calibration.json``) for ``model``."""
    from cachegen.codec import CodecError

    document = _read_calibration(path, model)
    try:
        return [QuantConfig.from_dict(choice["config"]) for choice in document["choices"]]
    except (KeyError, TypeError, CodecError) as exc:
        raise InputError(f"{path} has a malformed choice: {exc}") from exc


def ppl_per_kl(trials: list[Trial], target: float) -> float:
    """Least-squares slope (through the origin) of |perplexity change| on KL, over the trials
    within a few targets (the regime that matters). A change in either direction counts:
    decoded KV that makes the text more likely is still not the original model."""
    measured = [t for t in trials if t.kl > 0]
    near = [t for t in measured if abs(t.ppl_change_pct) <= 5 * target] or measured
    num = sum(t.kl * abs(t.ppl_change_pct) for t in near)
    den = sum(t.kl * t.kl for t in near)
    if den <= 0 or num <= 0:
        raise InputError(
            "calibration could not relate KL to perplexity (no quantization effect measured)"
        )
    return num / den
