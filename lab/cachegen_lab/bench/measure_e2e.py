"""End-to-end measurements through real vLLM: TTFT, latency and output rate per mode.

Two engines per model serve the modes, one after the other, each the connector's
``ConnectorEngine`` (vLLM with the CacheGenConnector) on a store of its own, whose per-request
options pick the mode, level, quality bound and link bandwidth (see
``cachegen_lab.bench.engine_process``): one stores every encoding the fixed modes and
adaptive need (every cachegen level, the baselines, tcq levels that are named); the other
runs in the connector's default configuration and serves the modes a user gets by default,
the model's tcq default level and ``adaptive-fastest``, which then chooses among the forms of
the default save ladder only (``DEFAULT_CONFIGURATION_MODES``). Per context each engine first
prefills the context once with saving on and waits until every encoding is stored; then for
each KV mode one unmeasured warm-up request checks that the mode loads and pays its one-time
costs (codec tables, kernels), and only then are the measured requests sent. Text recompute
runs on the first engine with loading and saving off; when the connector cannot start at all
it runs on a plain engine instead, and every KV mode is recorded as missing with the reason.

A KV-mode request that loaded nothing is not a measurement of that mode (vLLM simply
recomputed): it is recorded under ``missing`` with the connector's error, never as a run.
A peer codec (``cachegen_lab.peers``) is stored on the first engine beside the others, unless
it refuses the records the connector stores for the model (:func:`peer_refusal`): then it is
missing with the codec's reason, and the engine never tries to save it.

Each run is the request's ``RequestRow`` (the row the TTFT tables are made of, built in the
engine's process) as a results ``Run``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from cachegen.errors import CacheGenError
from cachegen.modes import ADAPTIVE, ADAPTIVE_FASTEST, CACHEGEN, RECOMPUTE, TCQ, Mode
from cachegen_lab.bench.engine_process import EngineError, EngineSession, RequestFailed
from cachegen_lab.bench.modes import tcq_default
from cachegen_lab.bench.prompts import Context, question
from cachegen_lab.peers import PEER_MODES
from cachegen_lab.rows import RequestRow, Run

MARGIN_TOKENS = 64  # room for the question after the context
WARM_UP_REPEAT = 999  # question number of unmeasured requests (never one of the measured repeats)
PROBE_TOKENS = 16  # tokens of random KV a peer codec is tried on


def connector_options(chunk_tokens: int, kv_modes: list[Mode], cachegen_levels: list[int]) -> dict:
    """Engine-wide connector options (``ConnectorEngine``'s, but the store): chunking and
    every encoding to save. Every cachegen level is stored (the connector's default stores a
    small ladder), so that each measured level loads and adaptive chooses among all the
    calibrated levels."""
    save_modes = sorted({CACHEGEN if m.mode == ADAPTIVE else m.mode for m in kv_modes})
    options = {"chunk_tokens": chunk_tokens, "save_modes": save_modes}
    if CACHEGEN in save_modes:
        options["cachegen_levels"] = list(cachegen_levels)
    tcq_levels = sorted({m.level for m in kv_modes if m.mode == TCQ and m.level is not None})
    if tcq_levels:  # the measured ones (the connector's default stores its save ladder)
        options["connector_extra"] = {"tcq_levels": tcq_levels}
    return options


def default_options(chunk_tokens: int) -> dict:
    """The connector's default configuration (but the store and chunking): it saves the
    model's default mode, in its default save ladder."""
    return {"chunk_tokens": chunk_tokens, "save_modes": None}


def peer_refusal(spec, codec_name: str, chunk_tokens: int) -> str | None:
    """Why the peer codec ``codec_name`` cannot encode the records the connector stores for
    ``spec`` (None: it can), tried on a few tokens of random KV per record. A model with
    sliding-window and full-attention layers has a record per kind of layer, which a codec of
    the whole model's layers may refuse (LMCache's CacheGen, Gemma 3's full-attention layers)."""
    from cachegen.connector.parts import RecordParts
    from cachegen.kv import KVCache
    from cachegen.profiles import codec_for

    identity = spec.identity()
    parts = RecordParts.of(spec, chunk_tokens)
    layer_sets = (parts.full_layers, parts.sliding_layers) if parts.split else (None,)
    try:
        codec = codec_for(codec_name, spec, build=False, chunk_tokens=chunk_tokens)
        for layers in layer_sets:
            count = identity.num_layers if layers is None else len(layers)
            shape = (count, identity.num_kv_heads, PROBE_TOKENS, identity.head_dim)
            keys, values = torch.randn(shape), torch.randn(shape)
            ids = torch.arange(PROBE_TOKENS)
            codec.encode(KVCache(keys, values, ids, identity, layers=layers))
    except CacheGenError as exc:
        return f"{codec_name} cannot encode the connector's records of {spec.name}: {exc}"
    return None


def default_configuration(mode: Mode, model: str) -> bool:
    """Whether ``mode`` is measured on the engine in the connector's default configuration:
    ``adaptive-fastest``, and the model's tcq default level."""
    default = tcq_default(model)
    return mode.mode == ADAPTIVE_FASTEST or (
        default is not None and mode == Mode(TCQ, default.level)
    )


class E2EMeasurer:
    """Fills ``runs`` and ``missing`` (lists of results.json rows) for one model."""

    def __init__(
        self,
        cfg,
        model: str,
        spec,
        identity,
        contexts: list[Context],
        tokenizer,
        *,
        runs: list,
        missing: list,
        tick,
        log=None,
    ) -> None:
        self.cfg, self.model, self.spec, self.identity = cfg, model, spec, identity
        self.contexts, self.tokenizer = contexts, tokenizer
        self.runs, self.missing, self.tick, self.log = runs, missing, tick, log
        self.max_model_len = min(
            spec.max_positions, max(c.tokens for c in contexts) + MARGIN_TOKENS + cfg.output_tokens
        )
        self.notes: list[str] = []

    # ---- planning ---------------------------------------------------------------------

    def run(self) -> None:
        modes = self.cfg.modes_of(self.model)
        kv_modes = [m for m in modes if m.moves_kv and self._has_bound(m) and self._storable(m)]
        recompute = Mode(RECOMPUTE) in modes
        shared = [m for m in kv_modes if not default_configuration(m, self.model)]
        default = [m for m in kv_modes if default_configuration(m, self.model)]
        done_recompute = False
        if shared:
            options = connector_options(self.cfg.chunk_tokens, shared, self._cachegen_levels())
            done_recompute = self._with_connector(shared, recompute, options)
        if default:
            options = default_options(self.cfg.chunk_tokens)
            done_recompute |= self._with_connector(
                default, recompute and not done_recompute, options
            )
            self.notes.append(
                f"{', '.join(m.label for m in default)} ran on an engine of their own in the "
                "connector's default configuration (its default save ladder only)"
            )
        if recompute and not done_recompute:
            try:
                with self._session(None) as engine:
                    self._warm_up(engine)
                    self._recompute(engine)
                self.notes.append("recompute ran on a plain vLLM engine (no connector)")
            except EngineError as exc:
                for context in self._contexts_of(Mode(RECOMPUTE)):
                    self._missing(Mode(RECOMPUTE), f"vLLM engine failed: {exc}", context)

    def _has_bound(self, mode: Mode) -> bool:
        """False for ``adaptive-fastest`` without a quality bound for this model, recorded as
        missing at each of its contexts."""
        if mode.mode != ADAPTIVE_FASTEST or self.model in self.cfg.max_loss_pct:
            return True
        for context in self._contexts_of(mode):
            self._missing(
                mode,
                f"{self.model} ships no tcq calibration with a default level, whose target is "
                "the quality bound (max_loss_pct) of adaptive-fastest",
                context,
            )
            self.tick(len(self.cfg.links_of(mode)) * self.cfg.repeats)
        return False

    def _storable(self, mode: Mode) -> bool:
        """False for a peer codec that refuses this model's records (:func:`peer_refusal`),
        recorded as missing at each of its contexts."""
        if mode.mode not in PEER_MODES:
            return True
        reason = peer_refusal(self.spec, mode.mode, self.cfg.chunk_tokens)
        if reason is None:
            return True
        for context in self._contexts_of(mode):
            self._missing(mode, reason, context)
            self.tick(len(self.cfg.links_of(mode)) * self.cfg.repeats)
        return False

    def _contexts_of(self, mode: Mode) -> list[Context]:
        """The contexts at which ``mode`` is measured."""
        return [c for c in self.contexts if mode in self.cfg.modes_at(self.model, c.tokens)]

    def _cachegen_levels(self) -> list[int]:
        from cachegen.profiles import codec_for

        return list(codec_for(CACHEGEN, self.model).levels)

    def _session(self, connector: dict | None) -> EngineSession:
        return EngineSession(self.model, self.max_model_len, connector=connector, log=self.log)

    def _with_connector(self, kv_modes: list[Mode], recompute: bool, options: dict) -> bool:
        """Measure ``kv_modes`` (and ``recompute``) with one connector engine of ``options``
        on a fresh store; True when recompute was measured on it."""
        done_recompute = False
        try:
            with (
                tempfile.TemporaryDirectory(prefix="cachegen-bench-store-") as store_dir,
                self._session({**options, "store": Path(store_dir).as_uri()}) as engine,
            ):
                self._warm_up(engine)
                if recompute:
                    self._recompute(engine)
                    done_recompute = True
                    self.notes.append(
                        "recompute ran on the connector engine with loading and saving off"
                    )
                for context in self.contexts:
                    modes = self.cfg.modes_at(self.model, context.tokens)
                    self._store(engine, context, [m for m in kv_modes if m in modes])
        except EngineError as exc:
            self._missing_unless_done(
                kv_modes, f"vLLM engine with the CacheGenConnector failed: {exc}"
            )
        return done_recompute

    # ---- measuring --------------------------------------------------------------------

    def _warm_up(self, engine: EngineSession) -> None:
        """One unmeasured request: the first forward pass of an engine is slower."""
        engine.run(
            self.contexts[0].prompt(question(self.tokenizer, WARM_UP_REPEAT)),
            mode=RECOMPUTE,
            max_tokens=2,
        )

    def _recompute(self, engine: EngineSession) -> None:
        for context in self._contexts_of(Mode(RECOMPUTE)):
            for repeat in range(self.cfg.repeats):
                request = engine.run(
                    context.prompt(question(self.tokenizer, repeat)),
                    mode=RECOMPUTE,
                    max_tokens=self.cfg.output_tokens,
                )
                self.runs.append(self._run(request, context, repeat, Mode(RECOMPUTE)))
                self.tick()

    def _cells(self, mode: Mode) -> int:
        """The measured requests of ``mode`` at one context."""
        return len(self.cfg.links_of(mode)) * self.cfg.repeats

    def _store(self, engine: EngineSession, context: Context, kv_modes: list[Mode]) -> None:
        if context.tokens < self.cfg.chunk_tokens:
            for mode in kv_modes:
                self._missing(
                    mode,
                    f"the {context.tokens}-token context is shorter than one "
                    f"{self.cfg.chunk_tokens}-token chunk, so nothing of it can be stored",
                    context,
                )
                self.tick(self._cells(mode))
            return
        try:
            engine.store_prefix(context.prompt(question(self.tokenizer, WARM_UP_REPEAT)))
        except RequestFailed as exc:
            for mode in kv_modes:
                self._missing(mode, f"storing the context failed: {exc}", context)
                self.tick(self._cells(mode))
            return
        for mode in kv_modes:
            self._measure_mode(engine, context, mode)

    def _measure_mode(self, engine: EngineSession, context: Context, mode: Mode) -> None:
        error = self._check_loads(engine, context, mode)
        if error is not None:
            self._missing(mode, error, context)
            self.tick(self._cells(mode))
            return
        for bandwidth in self.cfg.links_of(mode):
            for repeat in range(self.cfg.repeats):
                try:
                    request = self._request(
                        engine, context, mode, bandwidth, repeat, self.cfg.output_tokens
                    )
                except RequestFailed as exc:
                    self._missing(
                        mode, f"request at {bandwidth:g} Mbit/s failed: {exc}", context, bandwidth
                    )
                    self.tick()
                    continue
                if not request.loaded_tokens:
                    why = request.load_error or "the connector loaded no tokens"
                    self._missing(
                        mode,
                        f"request at {bandwidth:g} Mbit/s loaded nothing: {why}",
                        context,
                        bandwidth,
                    )
                else:
                    self.runs.append(self._run(request, context, repeat, mode))
                self.tick()

    def _request(
        self,
        engine: EngineSession,
        context: Context,
        mode: Mode,
        bandwidth: float | None,
        repeat: int,
        max_tokens: int,
    ) -> RequestRow:
        return engine.run(
            context.prompt(question(self.tokenizer, repeat)),
            mode=mode.connector_mode,
            level=mode.level,
            bandwidth_mbps=bandwidth,
            slo_ms=self.cfg.slo_ms if mode.mode == ADAPTIVE else None,
            max_loss_pct=self.cfg.max_loss_pct[self.model]
            if mode.mode == ADAPTIVE_FASTEST
            else None,
            max_tokens=max_tokens,
        )

    def _check_loads(self, engine: EngineSession, context: Context, mode: Mode) -> str | None:
        """Warm ``mode`` up with one unlimited-rate request; the reason when it loads nothing."""
        try:
            request = self._request(engine, context, mode, None, WARM_UP_REPEAT, 2)
        except RequestFailed as exc:
            return f"the warm-up request failed: {exc}"
        if request.loaded_tokens:
            return None
        return request.load_error or "the connector loaded no tokens of the stored context"

    def _missing_unless_done(self, kv_modes: list[Mode], reason: str) -> None:
        """After an engine failure: every (mode, context) without a run or a reason gets
        ``reason``."""
        done = {
            (r["mode"], r["level"], r["context_tokens"])
            for r in self.runs
            if r["model"] == self.model and r["kind"] == "e2e"
        }
        done |= {
            (m["mode"], m["level"], m["context_tokens"])
            for m in self.missing
            if m["model"] == self.model and m["kind"] == "e2e"
        }
        for mode in kv_modes:
            for context in self._contexts_of(mode):
                if (mode.mode, mode.level, context.tokens) not in done:
                    self._missing(mode, reason, context)

    # ---- rows -------------------------------------------------------------------------

    def _run(self, request: RequestRow, context: Context, repeat: int, mode: Mode) -> dict:
        """The results run of ``request``, made for ``mode`` (the sweep's name of what the
        request asked the connector for)."""
        loaded, nbytes = request.loaded_tokens, request.bytes
        g = self.identity  # 2 tensors (K, V) x 2 bytes per element in 16-bit floats
        fp16_bytes = loaded * g.num_layers * g.num_kv_heads * g.head_dim * 4 if loaded else None
        return Run.of(
            request,
            kind="e2e",
            mode=mode.mode,
            level=mode.level,
            context_tokens=context.tokens,
            repeat=repeat,
            ratio_vs_fp16=fp16_bytes / nbytes if fp16_bytes and nbytes else None,
        ).to_dict()

    def _missing(
        self,
        mode: Mode,
        reason: str,
        context: Context | None = None,
        bandwidth: float | None = None,
    ) -> None:
        self.missing.append(
            {
                "kind": "e2e",
                "model": self.model,
                "mode": mode.mode,
                "level": mode.level,
                "context_tokens": context.tokens if context else None,
                "bandwidth_mbps": bandwidth,
                "reason": reason,
            }
        )
