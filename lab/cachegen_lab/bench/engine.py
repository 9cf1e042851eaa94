"""A vLLM engine with the cachegen connector, kept alive across many measurements.

Engine start-up costs seconds to minutes, so one ``ConnectorEngine`` serves every mode,
level and bandwidth through per-request ``kv_transfer_params``:

    with ConnectorEngine("smollm2-135m", save_modes=("raw", "int8", "fp8", "cachegen")) as engine:
        ids = engine.tokenize(context) + engine.tokenize(question, bos=False)
        engine.store_prefix(ids)                    # prefill once, write every encoding
        again = engine.run(ids, mode="recompute")   # prefill the whole prompt (no connector)
        hit = engine.run(ids, mode="cachegen", level=1, bandwidth_mbps=100)
        hit.ttft_s, hit.connector["bytes"], hit.token_ids

Runs are driven step by step through ``LLMEngine.step`` so the wall-clock time to the first
token and to the last one are both observed in one run, next to vLLM's own
``RequestOutput.metrics.first_token_latency``.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cachegen.connector.config import RequestOptions
from cachegen.connector.errors import ConnectorError
from cachegen.connector.scheduler import REPORT_KEY
from cachegen.constants import CHUNK_TOKENS
from cachegen.cpu import engine_dtype
from cachegen.errors import InputError
from cachegen.models import EMBEDDED_DEFAULT, ModelSpec, resolve
from cachegen.modes import CACHEGEN, RECOMPUTE, TCQ, Form, connector_modes
from cachegen_lab.bench.store_client import StoreClient
from cachegen_lab.connector import LAB_CONNECTOR, LAB_CONNECTOR_MODULE
from cachegen_lab.connector.options import LabRequestOptions, lab_config


@dataclass
class Measurement:
    """One request. Times in seconds (docs/benchmarks.md, "Vocabulary"); ``connector`` is the
    connector's report (bytes, levels, transfer_s, decode_s, inject_s, loaded_tokens,
    load_error, ...). ``cachegen_lab.rows.RequestRow.from_measurement`` makes it a row."""

    mode: str
    level: int | str | None  # a coded level, or a form's name (cachegen-11-packed)
    bandwidth_mbps: float | None
    slo_ms: float | None
    prompt_tokens: int
    ttft_s: float  # vLLM's RequestOutput.metrics.first_token_latency (arrival -> first token)
    ttft_wall_s: float | None  # wall clock from submitting to the first token
    e2e_s: float  # wall clock from submitting to the last token
    output_tokens: int
    output_tokens_per_s: float | None  # output rate after the first token
    cached_tokens: int  # prompt tokens vLLM did not compute (RequestOutput.num_cached_tokens)
    token_ids: list[int]
    connector: dict[str, Any] = field(default_factory=dict)
    # per output token, the greedy token's logprob minus the runner-up's (nats); only for
    # requests run with margins=True
    margins: list[float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def llvmlite_hidden_from_vllm() -> Iterator[None]:
    """Work around a vLLM 0.32 start-up crash when numba is already loaded.

    vLLM's CPU platform (``vllm/triton_utils/dispatcher.py``) scans the attributes of every
    loaded module and calls ``vars()`` on them; llvmlite's ``ffi.lib`` (loaded by numba, which
    the codec uses) answers ``__dict__`` with a function wrapper, and start-up dies with
    "'_lib_fn_wrapper' object has no attribute 'get'". That attribute is hidden while the
    engine starts and put back right after.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = ffi.__dict__.pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if lib is not None:
            ffi.lib = lib


@dataclass
class Submitted:
    """A request in flight: when it was submitted and when each output token arrived."""

    request_id: str
    mode: str
    level: int | str | None  # a coded level, or a form's name (cachegen-11-packed)
    bandwidth_mbps: float | None
    slo_ms: float | None
    prompt_tokens: int
    t_submit: float = 0.0
    t_end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    steps_to_first_token: int = 0  # engine steps from submission to the first token
    first_token_step_s: float = 0.0  # duration of the step that produced the first token
    final: Any = None

    def measurement(self) -> Measurement:
        if self.final is None or not self.token_times:
            raise ConnectorError(f"request {self.request_id} has not finished")
        tokens = list(self.final.outputs[0].token_ids)
        first = self.token_times[0]
        metrics = self.final.metrics
        return Measurement(
            mode=self.mode,
            level=self.level,
            bandwidth_mbps=self.bandwidth_mbps,
            slo_ms=self.slo_ms,
            prompt_tokens=self.prompt_tokens,
            ttft_s=float(metrics.first_token_latency)
            if metrics is not None
            else first - self.t_submit,
            ttft_wall_s=first - self.t_submit,
            e2e_s=self.t_end - self.t_submit,
            output_tokens=len(tokens),
            output_tokens_per_s=(len(tokens) - 1) / (self.t_end - first)
            if self.t_end > first
            else 0.0,
            cached_tokens=int(self.final.num_cached_tokens or 0),
            token_ids=tokens,
            connector=dict((self.final.kv_transfer_params or {}).get(REPORT_KEY, {})),
            margins=_margins(self.final.outputs[0].logprobs),
        )


def configured_levels(codec: str, levels: Sequence[int | str | Form]) -> list[int | str]:
    """``levels`` as a connector's configuration names them: a coded level as the number, a
    form (``cachegen-11-packed``) by its name."""
    return [lv.label if isinstance(lv, Form) else lv for lv in levels]


def _margins(logprobs: Any) -> list[float] | None:
    """Per output token, the top logprob minus the second (vLLM's per-token dicts of the
    sampled token and the top two), or None when the request asked for no logprobs."""
    if logprobs is None:
        return None
    margins = []
    for candidates in logprobs:
        best = sorted((c.logprob for c in candidates.values()), reverse=True)
        margins.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    return margins


class ConnectorEngine(StoreClient):
    """An in-process vLLM ``LLM`` whose KV connector is ``CacheGenConnector``, storing the
    modes ``save_modes`` after a prefill (None: the connector's default mode for the model,
    with the connector's defaults for what it stores)."""

    WRITER = "the connector"
    ERROR = ConnectorError
    SAVE_TIMEOUT_S = 600.0

    def __init__(
        self,
        model: str | ModelSpec = EMBEDDED_DEFAULT,
        *,
        store: str | None = None,
        chunk_tokens: int = CHUNK_TOKENS,
        save_modes: Sequence[str] | None = ("raw",),
        cachegen_levels: Sequence[int | str | Form] | None = None,
        kv_role: str = "kv_both",
        shaper: str = "token-bucket",
        prefill_tokens_per_s: float | None = None,
        load_async: bool = True,
        save_async: bool = True,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        connector_extra: dict[str, Any] | None = None,
        **engine_args: Any,
    ) -> None:
        # In-process engine core: starts faster than the multiprocess one, and run() can step it.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.spec = model if isinstance(model, ModelSpec) else resolve(model)
        extra: dict[str, Any] = {
            "chunk_tokens": chunk_tokens,
            "shaper": shaper,
            "load_async": load_async,
            "save_async": save_async,
            "client_report": "full",  # the lab measures: it reads every figure of the report
        }
        if save_modes is not None:  # None: the connector's default mode for the model, saved
            extra.update(save_modes=list(save_modes), mode="raw")
        if store is not None:
            extra["store"] = store
        if cachegen_levels is not None:
            extra["cachegen_levels"] = configured_levels(CACHEGEN, cachegen_levels)
        if prefill_tokens_per_s is not None:
            extra["prefill_tokens_per_s"] = prefill_tokens_per_s
        extra.update(connector_extra or {})  # further kv_connector_extra_config keys
        if extra.get("tcq_levels") is not None:
            extra["tcq_levels"] = configured_levels(TCQ, extra["tcq_levels"])
        # Fail here, before vLLM starts; the same defaults as the connector's for the model.
        self.config, self.shaper = lab_config(extra, self.spec.identity())
        transfer = KVTransferConfig(
            kv_connector=LAB_CONNECTOR,
            kv_connector_module_path=LAB_CONNECTOR_MODULE,
            kv_role=kv_role,
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
        engine_args.setdefault("gpu_memory_utilization", 0.3)
        engine_args.setdefault("dtype", engine_dtype())  # float32 where bf16 is emulated
        with llvmlite_hidden_from_vllm():
            self.llm = LLM(
                model=str(self.spec.path),
                kv_transfer_config=transfer,
                enable_prefix_caching=False,  # every hit must come from the connector
                disable_log_stats=False,  # RequestOutput.metrics needs stats
                max_model_len=max_model_len or min(self.spec.max_positions, 8192),
                enforce_eager=enforce_eager,
                **engine_args,
            )
        self.tokenizer = self.llm.get_tokenizer()
        self._ids = itertools.count()
        self._running: dict[str, Submitted] = {}

    # ---- prompts -------------------------------------------------------------------------------

    def tokenize(self, text: str, *, bos: bool = True) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=bos)["input_ids"]
        if not ids:
            raise InputError("the text tokenizes to nothing")
        return list(ids)

    # ---- runs ----------------------------------------------------------------------------------

    def run(self, prompt_token_ids: Sequence[int], **options: Any) -> Measurement:
        """Greedily answer ``prompt_token_ids`` and wait for the answer; ``options`` are
        :meth:`submit`'s (``mode`` says where the prefix's KV comes from)."""
        request = self.submit(prompt_token_ids, **options)
        self.step_until_done([request])
        return request.measurement()

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        *,
        mode: str = RECOMPUTE,
        level: int | str | None = None,
        bandwidth_mbps: float | None = None,
        slo_ms: float | None = None,
        max_loss_pct: float | None = None,
        rtt_ms: float = 0.0,
        save: bool = False,
        max_tokens: int = 16,
        skip_out_of_window: bool | None = None,
        cache_salt: str | None = None,
        margins: bool = False,
    ) -> Submitted:
        """Add a request without waiting for it; drive it with :meth:`step_until_done`.
        ``mode`` is ``recompute`` or a connector mode; ``level`` a coded level of it, or the
        name of a form of it (``cachegen-11-packed``); ``margins`` records how far each greedy
        token led the runner-up."""
        from vllm import SamplingParams

        modes = (RECOMPUTE, *connector_modes())
        if mode not in modes:
            raise InputError(f"unknown mode {mode!r}; choose one of {', '.join(modes)}")
        if max_tokens < 2:
            raise InputError(
                "max_tokens must be >= 2 (the connector's report arrives after the first step)"
            )
        if mode == RECOMPUTE:
            params: dict[str, Any] = {"load": False, "save": save}
        else:
            params = {"mode": mode, "load": True, "save": save, "rtt_ms": rtt_ms}
            coded = level
            if isinstance(level, str):  # a form is asked by its name
                form = Form.parse(level)
                if form.codec != mode:
                    raise InputError(f"{level} is not a form of {mode}")
                del params["mode"]
                params["form"] = form.label
                coded = None
            for key, value in (
                ("level", coded),
                ("bandwidth_mbps", bandwidth_mbps),
                ("slo_ms", slo_ms),
                ("max_loss_pct", max_loss_pct),
                ("skip_out_of_window", skip_out_of_window),
            ):
                if value is not None:
                    params[key] = value
            LabRequestOptions().override(params)  # bad options fail here, not in the engine
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=2 if margins else None,
            extra_args={"kv_transfer_params": params},
        )
        request = Submitted(
            f"cachegen-{next(self._ids)}",
            mode,
            level,
            bandwidth_mbps,
            slo_ms,
            len(prompt_token_ids),
        )
        request.t_submit = time.perf_counter()
        prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
        if cache_salt is not None:
            prompt["cache_salt"] = cache_salt  # vLLM's per-request isolation key
        self.llm.llm_engine.add_request(request.request_id, prompt, sampling)
        self._running[request.request_id] = request
        return request

    def step_until_done(
        self, requests: Sequence[Submitted], until: Callable[[], bool] | None = None
    ) -> None:
        """Step the engine until ``requests`` are finished (or ``until()`` is true), recording
        when each of their tokens arrives."""
        engine = self.llm.llm_engine
        while not all(r.final is not None for r in requests) and engine.has_unfinished_requests():
            if until is not None and until():
                return
            began = time.perf_counter()
            outputs = engine.step()
            now = time.perf_counter()
            for request in self._running.values():
                if not request.token_times:
                    request.steps_to_first_token += 1
            for out in outputs:
                request = self._running.get(out.request_id)
                if request is None:
                    continue
                count = len(out.outputs[0].token_ids) if out.outputs else 0
                if count and not request.token_times:
                    request.first_token_step_s = now - began
                request.token_times.extend([now] * (count - len(request.token_times)))
                if out.finished:
                    request.final = out
                    request.t_end = now
                    del self._running[out.request_id]
        missing = [r.request_id for r in requests if r.final is None]
        if missing and until is None:
            raise ConnectorError(f"requests {missing} produced no output")

    # ---- the store -----------------------------------------------------------------------------

    def stored_chunks(
        self, prompt_token_ids: Sequence[int], mode: str = "raw", level: int | str | None = None
    ) -> int:
        """Leading chunks of the prompt stored for ``mode`` (``level``: a coded level, or a
        form's name)."""
        params = {"form": level} if isinstance(level, str) else {"mode": mode, "level": level}
        options = RequestOptions(slo_ms=1.0 if mode == "adaptive" else None).override(params)
        return self.transport.stored_chunks(list(prompt_token_ids), options)

    def store_prefix(
        self,
        prompt_token_ids: Sequence[int],
        timeout_s: float | None = None,
        cache_salt: str | None = None,
    ) -> Measurement:
        """Prefill the prompt from text with saving on, and wait until its chunks are stored."""
        result = self.run(
            prompt_token_ids, mode=RECOMPUTE, save=True, max_tokens=2, cache_salt=cache_salt
        )
        self.wait_stored(prompt_token_ids, timeout_s, cache_salt)
        return result

    def close(self) -> None:
        self._close_transport()
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            # The engine's model, KV cache and threads sit in reference cycles: freed only by a
            # collection, they would otherwise stay beside the next engine of this process.
            gc.collect()

    def __enter__(self) -> ConnectorEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
