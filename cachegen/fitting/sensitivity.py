"""How much each layer's keys and values matter to the model's predictions, measured.

The component weights (:mod:`cachegen.fitting.attention`) model what a unit of error costs a
layer's attention output, relative to the residual stream it is added to. What that output
error then does to the next-token distributions, through the layers above, they do not see.
So the fit measures it: on windows of the ``calibrate`` split, each (layer, K/V) stream
alone is quantized at one step (the others exact; the rows a coded frame refines, its
attention sinks, a quarter step finer: :mod:`cachegen.codec.tcq.refine`), and the KL
divergence of the continuation's next-token distributions from the exact KV's is divided by
the weighted squared error that the stream's quantization made. Multiplying a stream's
weights by that sensitivity makes one unit of weighted error cost the same KL in every
stream, which is what one step for the whole model (reverse water-filling) assumes.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import torch

from cachegen import models, workload
from cachegen.codec.tcq.refine import REFINE_RADIUS, REFINE_UNITS, refined_rows
from cachegen.codec.transform import kvtc_basis
from cachegen.codec.transform.basis import TransformBasis
from cachegen.codec.transform.rotary import rotate_layer_keys
from cachegen.fitting.kvtc import KVTC_CALIBRATION_SPLIT, KVTC_CALIBRATION_TOKENS, fit_kv
from cachegen.fitting.replay import continuation_logits

# calibration windows, after the tokens the basis is fitted on (fewer where the split is short)
SENSITIVITY_WINDOWS = 12
SENSITIVITY_CONTEXT = 1024  # context tokens per window (fewer where the model's limit is lower)
SENSITIVITY_SCORED = 64  # continuation tokens whose distributions are compared
SENSITIVITY_BITS = 1.5  # the calibration bits per element of the step the streams are measured at
SENSITIVITY_RANGE = 16.0  # a sensitivity is kept within this factor of the streams' mean


def sensitivity_spec() -> dict:
    """What the sensitivities are measured on; part of a tcq model's recipe."""
    return {
        "split": KVTC_CALIBRATION_SPLIT,
        "after_tokens": KVTC_CALIBRATION_TOKENS,
        "windows": SENSITIVITY_WINDOWS,
        "context_tokens": SENSITIVITY_CONTEXT,
        "scored_tokens": SENSITIVITY_SCORED,
        "bits": SENSITIVITY_BITS,
        "range": SENSITIVITY_RANGE,
        "refined": True,  # the rows coded frames refine are a quarter step finer here too
    }


def sensitivity_windows(tokenizer, spec: models.ModelSpec) -> list[torch.Tensor]:
    """Token ids of the measuring windows: consecutive windows of the ``calibrate`` split from
    where the basis's calibration tokens end (as many as the split holds, up to the count)."""
    ids = tokenizer(workload.text(KVTC_CALIBRATION_SPLIT))["input_ids"][KVTC_CALIBRATION_TOKENS:]
    length = min(SENSITIVITY_CONTEXT + SENSITIVITY_SCORED, spec.max_positions)
    count = min(SENSITIVITY_WINDOWS, len(ids) // length)
    return [torch.tensor(ids[i * length : (i + 1) * length]) for i in range(count)]


def stream_sensitivities(
    hf_model,
    spec: models.ModelSpec,
    basis: TransformBasis,
    weights: np.ndarray,
    steps: np.ndarray,
    windows: list[torch.Tensor],
) -> np.ndarray:
    """Each (layer, K/V) stream's KL per unit of weighted squared error [L, 2], over
    ``windows`` with every component rounded to its step (``steps`` [L, 2, C]); relative to
    the streams' geometric mean and kept within ``SENSITIVITY_RANGE`` of it."""
    L = weights.shape[0]
    kl, error = np.zeros((L, 2)), np.zeros((L, 2))
    scored = min(SENSITIVITY_SCORED, min(len(w) for w in windows) // 2)
    for ids in windows:
        context, continuation = ids[:-scored], ids[-scored:]
        kv = fit_kv(spec, context)
        passes = _ContinuationPasses(hf_model, kv, continuation)
        for layer in range(L):
            for k in (0, 1):
                perturbed, made = _quantized_stream(kv, basis, weights, steps, layer, k)
                kl[layer, k] += _kl(passes.reference, passes.perturbed(perturbed, layer))
                error[layer, k] += made
    ratio = np.maximum(kl, 1e-12) / np.maximum(error, 1e-30)
    ratio /= np.exp(np.log(ratio).mean())
    return np.clip(ratio, 1 / SENSITIVITY_RANGE, SENSITIVITY_RANGE)


def _quantized_stream(kv, basis: TransformBasis, weights, steps, layer: int, k: int):
    """``kv`` with stream (``layer``, ``k``) rounded to ``steps`` in the basis's coefficients
    (from the first non-exact token on), and the weighted squared error per token that made."""
    skip = kvtc_basis.EXACT_TOKENS
    thetas = basis.rope_thetas[layer : layer + 1]
    x = (kv.keys, kv.values)[k][layer : layer + 1, :, skip:].to(torch.float32)
    if k == 0:
        x = rotate_layer_keys(x, skip, thetas, inverse=True)
    x = x[0]
    H, n, D = x.shape
    rows = x.permute(1, 0, 2).reshape(n, H * D).double().numpy()
    components = basis.components[layer, k].astype(np.float64)
    y = (rows - basis.mean[layer, k]) @ components.T
    step = steps[layer, k].astype(np.float64)
    err = step * np.round(y / step) - y
    _refine(err, y, step, refined_rows(kv.values[layer : layer + 1, :, skip:].float())[0])
    made = float((err**2 @ weights[layer, k].astype(np.float64)).mean())
    delta = torch.from_numpy(err @ components).float().reshape(n, H, D).permute(1, 0, 2)
    if k == 0:
        delta = rotate_layer_keys(delta[None], skip, thetas)[0]
    # only the perturbed tensor is copied: the replay copies what it reads into its own cache
    out = (kv.keys, kv.values)[k].clone()
    out[layer, :, skip:] += delta.to(out.dtype)
    return replace(kv, **{("keys", "values")[k]: out}), made


def _refine(err: np.ndarray, y: np.ndarray, step: np.ndarray, rows: np.ndarray) -> None:
    """The rounding errors ``err`` [tokens, C] of coefficients ``y`` redone for ``rows`` (bool
    [tokens]) as a coded frame refines them (:mod:`cachegen.codec.tcq.refine`: its symbol,
    then a refinement in quarter steps), in place."""
    coarse = np.round(y[rows] / step)
    fine = np.round(REFINE_UNITS * (y[rows] / step - coarse))
    fine = np.clip(fine, -REFINE_RADIUS, REFINE_RADIUS)
    err[rows] = step * (coarse + fine / REFINE_UNITS) - y[rows]


class _ContinuationPasses:
    """The continuation's log-probabilities after a window's exact KV (:attr:`reference`) and
    after copies of it with one layer's stream perturbed. The exact pass keeps each decoder
    layer's output; a pass perturbed at layer ``l`` replays the outputs of the layers below
    ``l`` instead of running them: their inputs and KV are the exact pass's, so they would
    compute the same outputs, bit for bit. That saves about half of the layers' work."""

    def __init__(self, hf_model, kv, continuation: torch.Tensor) -> None:
        self.hf_model, self.continuation = hf_model, continuation
        self.layers = hf_model.get_decoder().layers
        self.outputs: list = []
        hooks = [layer.register_forward_hook(self._keep) for layer in self.layers]
        try:
            self.reference = self._log_probs(kv)
        finally:
            for hook in hooks:
                hook.remove()

    def _keep(self, module, args, output) -> None:
        self.outputs.append(output)

    def perturbed(self, kv, first_layer: int) -> torch.Tensor:
        """Log-probabilities after ``kv``, which differs from the exact KV only from layer
        ``first_layer`` on."""
        below = self.layers[:first_layer]
        for layer, output in zip(below, self.outputs):
            layer.forward = functools.partial(_replayed, output)
        try:
            return self._log_probs(kv)
        finally:
            for layer in below:
                del layer.forward

    def _log_probs(self, kv) -> torch.Tensor:
        logits = continuation_logits(self.hf_model, [kv], self.continuation)
        return logits[0].float().log_softmax(dim=-1)


def _replayed(output, *args, **kwargs):
    return output


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL divergence (nats per token) of ``other``'s distributions from ``reference``'s."""
    return float((reference.exp() * (reference - other)).sum(dim=-1).mean())
