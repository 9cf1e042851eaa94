"""The benchmark sweep behind ``cachegen bench`` and the asv suite: models x modes x
bandwidths x context lengths, measured three ways, into one results document.

  * ``e2e``: requests through real vLLM (TTFT, latency, throughput), see ``measure_e2e``;
  * ``stream``: the codec and the rate-limited loader over a real socket, without vLLM
    (bytes, ratios vs fp16 and int8, encode/transfer/decode time), see ``measure_stream``;
  * ``quality``: perplexity change and agreement with decoded KV, see ``measure_quality``.

Whatever cannot be measured (a mode the connector or codec does not offer yet, an engine
that fails) is listed under ``missing`` with the reason; no number is ever made up.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from cachegen.errors import CacheGenError, InputError
from cachegen.models import EMBEDDED, EMBEDDED_DEFAULT
from cachegen.modes import RECOMPUTE, Mode
from cachegen_lab.bench import environment, results
from cachegen_lab.bench.links import UNLIMITED
from cachegen_lab.bench.modes import expand, tcq_default, union
from cachegen_lab.bench.prompts import TEXT_SOURCE
from cachegen_lab.peers import LMCACHE_CACHEGEN

PARTS = ("e2e", "stream", "quality")
DEFAULT_MODELS_ENV = "CACHEGEN_BENCH_MODELS"  # comma-separated extra models for the profiles
# The profiles' modes: fp8 is left out (int8 is the paper's 8-bit baseline; --modes all has it).
PROFILE_MODES = ["recompute", "raw", "int8", "cachegen", "tcq", LMCACHE_CACHEGEN]
# Measured at the profile's largest context only, where the report compares them.
LARGEST_CONTEXT_MODES = ["raw", "cachegen-1", "cachegen-2", "cachegen-3", LMCACHE_CACHEGEN]
# Modes the profiles measure at some links only: the peer at the paper's slowest and fastest
# links, the two the report compares it at.
PROFILE_MODE_LINKS = {LMCACHE_CACHEGEN: [100.0, 1000.0]}


@dataclass
class SweepConfig:
    """What a sweep measures. ``modes`` are every model's modes together (the order of tables
    and figures); ``model_modes`` each model's own (unset: ``modes`` for every model);
    ``largest_context_modes`` are measured at the largest of ``context_tokens`` only;
    ``mode_bandwidth_mbps`` (by mode label) at those links only, end to end and streamed;
    ``max_loss_pct`` is ``adaptive-fastest``'s quality bound per model."""

    models: list[str]
    modes: list[Mode]
    bandwidth_mbps: list[float]
    context_tokens: list[int]
    repeats: int = 3
    output_tokens: int = 16
    quality_windows: int = 4
    quality_context_tokens: int = 1024
    slo_ms: float = 1000.0  # load-time budget of the adaptive mode
    max_loss_pct: dict[str, float] = field(default_factory=dict)
    model_modes: dict[str, list[Mode]] | None = None
    largest_context_modes: list[Mode] = field(default_factory=list)
    mode_bandwidth_mbps: dict[str, list[float]] = field(default_factory=dict)
    chunk_tokens: int = 256
    shaper: str = "token-bucket"
    parts: tuple[str, ...] = PARTS
    profile: str = "custom"
    notes: list[str] = field(default_factory=list)
    # The stream part's links (None: unlimited); unset, the same as bandwidth_mbps. Wider than
    # the end-to-end grid: a stream load costs about its decode time, a vLLM request more.
    stream_bandwidth_mbps: list[float | None] | None = None

    def __post_init__(self) -> None:
        if not self.models:
            raise InputError("no models given")
        if any(b <= 0 for b in self.bandwidth_mbps) or not self.bandwidth_mbps:
            raise InputError("bandwidths must be positive numbers of Mbit/s")
        if any(not links or min(links) <= 0 for links in self.mode_bandwidth_mbps.values()):
            raise InputError("a mode's bandwidths must be positive numbers of Mbit/s")
        if self.stream_bandwidth_mbps is not None and (
            not self.stream_bandwidth_mbps
            or any(b is not None and b <= 0 for b in self.stream_bandwidth_mbps)
        ):
            raise InputError(f"stream bandwidths must be positive numbers of Mbit/s or {UNLIMITED}")
        if any(c < 1 for c in self.context_tokens) or not self.context_tokens:
            raise InputError("context lengths must be positive numbers of tokens")
        if self.repeats < 1 or self.output_tokens < 1 or self.quality_windows < 0:
            raise InputError("repeats and output tokens must be >= 1, quality windows >= 0")
        unknown = set(self.parts) - set(PARTS)
        if unknown:
            raise InputError(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
        if any(bound < 0 for bound in self.max_loss_pct.values()):
            raise InputError("quality bounds (max_loss_pct) must be >= 0")

    def modes_of(self, model: str) -> list[Mode]:
        """The modes measured for ``model``."""
        return list((self.model_modes or {}).get(model, self.modes))

    def modes_at(self, model: str, context_tokens: int) -> list[Mode]:
        """The modes measured for ``model`` at a context of ``context_tokens``."""
        largest = context_tokens == max(self.context_tokens)
        return [m for m in self.modes_of(model) if largest or m not in self.largest_context_modes]

    @property
    def stream_links(self) -> list[float | None]:
        """The stream part's bandwidths, None for the unlimited link."""
        if self.stream_bandwidth_mbps is None:
            return list(self.bandwidth_mbps)
        return list(self.stream_bandwidth_mbps)

    def links_of(self, mode: Mode) -> list[float]:
        """The bandwidths ``mode`` is measured at end to end."""
        return list(self.mode_bandwidth_mbps.get(mode.label, self.bandwidth_mbps))

    def stream_links_of(self, mode: Mode) -> list[float | None]:
        """The stream part's bandwidths of ``mode``: its own links, where it has them."""
        return list(self.mode_bandwidth_mbps.get(mode.label, self.stream_links))

    def to_json(self) -> dict:
        return {
            "profile": self.profile,
            "models": list(self.models),
            "modes": [m.label for m in self.modes],
            "bandwidth_mbps": list(self.bandwidth_mbps),
            "stream_bandwidth_mbps": self.stream_links,
            "context_tokens": list(self.context_tokens),
            "repeats": self.repeats,
            "output_tokens": self.output_tokens,
            "quality_windows": self.quality_windows,
            "quality_context_tokens": self.quality_context_tokens,
            "slo_ms": self.slo_ms,
            "max_loss_pct": dict(self.max_loss_pct),
            "model_modes": {m: [mode.label for mode in self.modes_of(m)] for m in self.models},
            "largest_context_modes": [m.label for m in self.largest_context_modes],
            "mode_bandwidth_mbps": {m: list(b) for m, b in self.mode_bandwidth_mbps.items()},
            "chunk_tokens": self.chunk_tokens,
            "shaper": self.shaper,
            "parts": list(self.parts),
            "text": TEXT_SOURCE,
            "notes": list(self.notes),
        }


def profile(name: str, **overrides) -> SweepConfig:
    """The named profile with ``overrides`` (None values are ignored; ``modes`` are labels).

    ``default`` is what ``make bench`` runs: every embedded model (``models.EMBEDDED``) plus
    ``$CACHEGEN_BENCH_MODELS``, at most 25 minutes on a 2-core machine. Per model it measures
    recompute, raw, int8, the paper's cachegen levels 1-3, the model's default cachegen level
    and adaptive, and the model's tcq default level and ``adaptive-fastest`` over the
    connector's default save ladder (``PROFILE_MODES``; a group's levels are each model's
    own). To make room for tcq's modes within the 25 minutes: fp8 is left out (int8 is the
    paper's 8-bit baseline), and raw and the paper's levels 1-3 are measured at the largest
    context only (``LARGEST_CONTEXT_MODES``: the report compares at the largest context; raw is
    the dearest cell, 188 MB per 4,096 SmolLM2 tokens in a float32 engine); 3 repeats instead
    of 2 would overrun the budget. LMCache's CacheGen (``lmcache-cachegen``, the lab's peer)
    is measured at the largest context and at 100 and 1,000 Mbit/s only
    (``PROFILE_MODE_LINKS``): what the report's column for it compares. Overriding the modes
    or the contexts measures every mode at every context; overriding them or the links, every
    mode at every link. ``quick`` is its smoke version (the same modes at one short context):
    the default model plus ``$CACHEGEN_BENCH_MODELS`` (each model costs two vLLM engine starts,
    whatever the grid). What each profile takes is measured in docs/benchmarks.md, "How long
    it takes".
    """
    extra = [m.strip() for m in os.environ.get(DEFAULT_MODELS_ENV, "").split(",") if m.strip()]
    base_models = list(EMBEDDED) if name == "default" else [EMBEDDED_DEFAULT]
    chosen = overrides.get("models") or list(dict.fromkeys([*base_models, *extra]))
    common = dict(models=chosen, modes=PROFILE_MODES, mode_bandwidth_mbps=PROFILE_MODE_LINKS)
    if name == "default":
        base = dict(
            common,
            largest_context_modes=LARGEST_CONTEXT_MODES,
            bandwidth_mbps=[100.0, 500.0, 1000.0],
            stream_bandwidth_mbps=[100.0, 500.0, 1000.0, 5000.0, 20000.0, None],
            context_tokens=[1536, 4096],
            repeats=2,  # with both models, 3 repeats overrun the 25-minute budget on 2 cores
            output_tokens=16,
            quality_windows=4,
            quality_context_tokens=1024,
        )
    elif name == "quick":
        base = dict(
            common,
            bandwidth_mbps=[100.0, 1000.0],
            context_tokens=[512],
            repeats=1,
            output_tokens=8,
            quality_windows=1,
            quality_context_tokens=256,
        )
    else:
        raise InputError(f"unknown profile {name!r}; use default or quick")
    given = {k: v for k, v in overrides.items() if v is not None}
    merged = {**base, **given}
    if "bandwidth_mbps" in given and "stream_bandwidth_mbps" not in given:
        merged["stream_bandwidth_mbps"] = None  # the stream part follows the given rates
    if "modes" in given or "context_tokens" in given or "bandwidth_mbps" in given:
        merged.pop("mode_bandwidth_mbps", None)  # a custom grid is measured whole
    if "modes" in given or "context_tokens" in given:
        merged.pop("largest_context_modes", None)
    cfg = SweepConfig(profile=name if not given else "custom", **_modes(merged))
    if given:
        cfg.notes.append(f"based on the {name} profile")
    return cfg


def _modes(settings: dict) -> dict:
    """``settings`` with its mode labels expanded for each model (``model_modes``, and all of
    them as ``modes``), the largest-context modes parsed, and ``adaptive-fastest``'s bound
    per model that has one (its tcq default level's calibration target)."""
    models = settings["models"]
    model_modes = {model: expand(settings["modes"], model) for model in models}
    defaults = {model: tcq_default(model) for model in models}
    return {
        **settings,
        "modes": union(model_modes.values()),
        "model_modes": model_modes,
        "largest_context_modes": [Mode.parse(m) for m in settings.get("largest_context_modes", [])],
        "max_loss_pct": {m: d.target_pct for m, d in defaults.items() if d is not None},
    }


def run_sweep(cfg: SweepConfig, *, command: str, progress: bool = True, log=None) -> dict:
    """Measure everything ``cfg`` asks for; returns a validated results document."""
    doc = results.new_document(command, environment.capture(), cfg.to_json())
    doc["config"]["part_seconds"] = {}  # wall time per model and part, for sizing profiles
    bar = tqdm(
        total=sum(_cells(cfg, model) for model in cfg.models),
        desc="cachegen bench",
        unit="run",
        disable=not progress,
        file=sys.stderr,
    )
    try:
        sweep = _Sweep(cfg, doc, bar, log)
        for model in cfg.models:
            sweep.measure(model)
    finally:
        bar.close()
    return results.finish(doc)


@dataclass
class _Sweep:
    """Fills one results document, model by model, timing each part."""

    cfg: SweepConfig
    doc: dict
    bar: tqdm
    log: Callable[[str], None] | None

    @contextlib.contextmanager
    def part(self, name: str):
        self.bar.set_postfix_str(name)
        began = time.perf_counter()
        yield
        self.doc["config"]["part_seconds"][name] = round(time.perf_counter() - began, 1)

    def measure(self, model: str) -> None:
        from cachegen_lab.bench.measure_e2e import E2EMeasurer
        from cachegen_lab.bench.measure_quality import measure_quality
        from cachegen_lab.bench.measure_stream import measure_stream

        cfg, doc = self.cfg, self.doc
        with self.part(f"{model} prepare"):
            spec, identity, tokenizer, ctxs = self.prepare(model)
        sinks = dict(missing=doc["missing"], tick=self.bar.update)
        if "e2e" in cfg.parts:
            with self.part(f"{model} e2e"):
                measurer = E2EMeasurer(
                    cfg,
                    model,
                    spec,
                    identity,
                    ctxs,
                    tokenizer,
                    runs=doc["runs"],
                    **sinks,
                    log=self.log,
                )
                measurer.run()
                doc["config"]["notes"] += [f"{model}: {n}" for n in measurer.notes]
        if "stream" in cfg.parts:
            with self.part(f"{model} stream"):
                measure_stream(cfg, model, ctxs, runs=doc["runs"], **sinks)
        if "quality" in cfg.parts:
            with self.part(f"{model} quality"):
                measure_quality(cfg, model, quality=doc["quality"], **sinks)

    def prepare(self, model: str):
        """``model``'s spec, identity, tokenizer and the sweep's contexts in its tokens."""
        from transformers import AutoTokenizer

        from cachegen import models
        from cachegen_lab.bench.measure_e2e import MARGIN_TOKENS
        from cachegen_lab.bench.prompts import contexts

        cfg = self.cfg
        spec = models.resolve(model)
        identity = spec.identity()
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        too_long = [
            c
            for c in cfg.context_tokens
            if c + MARGIN_TOKENS + cfg.output_tokens > spec.max_positions
        ]
        if too_long:
            raise InputError(
                f"contexts {too_long} do not fit {model}'s {spec.max_positions} "
                f"positions with the question and {cfg.output_tokens} output tokens; "
                "choose shorter --context-tokens"
            )
        ctxs = contexts(tokenizer, cfg.context_tokens)
        config = self.doc["config"]
        config.setdefault("default_levels", {})[model] = _default_level(model)
        tcq = tcq_default(model)
        config.setdefault("tcq_default_levels", {})[model] = tcq.level if tcq else None
        return spec, identity, tokenizer, ctxs


def _default_level(model: str) -> int | None:
    """The level the cachegen codec uses for ``model`` when none is asked for."""
    try:
        from cachegen.profiles import codec_for

        return codec_for("cachegen", model).default_level
    except CacheGenError:
        return None


def _cells(cfg: SweepConfig, model: str) -> int:
    """Progress units of ``model``."""
    n = 0
    for context in cfg.context_tokens:
        modes = cfg.modes_at(model, context)
        kv = [m for m in modes if m.moves_kv]
        if "e2e" in cfg.parts:
            requests = int(Mode(RECOMPUTE) in modes) + sum(len(cfg.links_of(m)) for m in kv)
            n += cfg.repeats * requests
        if "stream" in cfg.parts:
            n += len([m for m in kv if m.codec_name])
    if "quality" in cfg.parts and cfg.quality_windows:
        n += 1
    return n
