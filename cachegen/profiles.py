"""Building codec profiles: the one place that runs a model to make probability tables.

The codec (``cachegen.codec``) only reads profiles and tables. Building them needs the
model's KV of the calibration text, so it lives here, above both the codec and extraction:

* :func:`calibration_spec` / :func:`calibration_kv`: what tables are calibrated on (the
  workload's ``tables`` split, first ``CALIBRATION_TOKENS`` tokens, one prefill, quantized
  in chunks of ``CHUNK_TOKENS``) and its KV.
* :func:`build_tables`: tables for one quantization config, written to the local tables
  directory (their id is their content hash, so building twice writes nothing new).
* :func:`ensure_profile`: the model's profile, built on first use with the paper presets
  and any shipped calibrated levels; rebuilt when it was calibrated on other text; missing
  tables of an existing profile are rebuilt and must come out identical.
* :func:`add_level`: a calibrated level into the profile (``cachegen calibrate``).
* :func:`ensure_kvtc_basis`: the model's KVTC basis (``cachegen.codec.kvtc``), PCA fitted on
  the workload's ``calibrate`` split only, built on first use.
* :func:`ensure_tcq_model`: the model's ``tcq`` model (``cachegen.codec.tcq``): the KVTC
  basis, component weights from the model's queries and output projections, and each
  level's rANS tables from the ``calibrate`` split's histograms; built on first use.

Building is deterministic as long as the model's forward pass is (same weights, same torch
CPU kernels); if a rebuilt table differs, the error says so and how to copy the file.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from cachegen import models, workload
from cachegen.codec import kvtc, rans, tcq
from cachegen.codec.errors import CodecError
from cachegen.codec.profile import (
    DEFAULT_LEVEL,
    Profile,
    locked,
    profile_path,
    read_profile,
    shipped_levels,
)
from cachegen.codec.quant import (
    QuantConfig,
    alphabet_size,
    apply_rotary,
    paper_levels,
    quantize_chunk,
    rotary_cos_sin,
    rotate_layer_keys,
)
from cachegen.codec.tables import (
    KINDS,
    LOCAL,
    LevelTables,
    TablesRefused,
    alphabets,
    num_segments,
    save_tables,
    tables_file,
)
from cachegen.codec.transform import TransformBasis, allocate_bits, fit_pca, save_basis
from cachegen.constants import CHUNK_TOKENS
from cachegen.kv import KVCache

CALIBRATION_TOKENS = 2048
KVTC_CALIBRATION_SPLIT = "calibrate"
KVTC_CALIBRATION_TOKENS = 4096
# The model runs in float32 for the tables' calibration KV, which is then rounded to bf16 as
# served KV is: every CPU kind rounds bf16 arithmetic differently, and without bf16
# instructions bf16 is several times slower than float32.
CALIBRATION_MODEL_DTYPE = torch.float32


def calibration_spec() -> dict:
    """What tables are calibrated on; part of every tables id and profile."""
    return {
        "source": "pydoc_data.topics",
        "topics": workload.topics("tables"),
        "text_sha256": hashlib.sha256(workload.text("tables").encode()).hexdigest(),
        "max_tokens": CALIBRATION_TOKENS,
        "chunk_tokens": CHUNK_TOKENS,
        "model_dtype": str(CALIBRATION_MODEL_DTYPE).removeprefix("torch."),
    }


@functools.lru_cache(maxsize=2)
def _calibration_kv(name: str, fingerprint: str) -> KVCache:
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(name)
    ids = tokenizer(workload.text("tables"))["input_ids"][:CALIBRATION_TOKENS]
    ids = torch.tensor(ids, dtype=torch.int64)[: spec.max_positions]
    return extract_kv(spec, token_ids=ids, dtype=CALIBRATION_MODEL_DTYPE).to(torch.bfloat16)


def calibration_kv(spec: models.ModelSpec) -> KVCache:
    """KV of the calibration text (cached per process)."""
    return _calibration_kv(spec.name, spec.identity().fingerprint)


def _count_symbols(kv: KVCache, config: QuantConfig) -> np.ndarray:
    """Symbol counts ``[tables, width]`` of the calibration KV quantized with ``config``."""
    L, H, D = kv.num_layers, kv.num_kv_heads, kv.head_dim
    C, S = H * D, num_segments(config)
    width = max(alphabet_size(b) for b in config.key_bins + config.value_bins)
    counts = torch.zeros(L * 2 * S * C * width, dtype=torch.int64)
    layer = torch.arange(L).view(L, 1, 1)
    channel = torch.arange(C).view(1, C, 1)
    for chunk in kv.chunks(CHUNK_TOKENS):
        for k, kind in enumerate(KINDS):
            x = chunk.keys if kind == "k" else chunk.values
            for s, seg in enumerate(quantize_chunk(x, config, kind, chunk.start)):
                sym = seg.symbols.permute(0, 1, 3, 2).reshape(L, C, -1).to(torch.int64)
                row = ((layer * 2 + k) * S + s) * C + channel
                counts += torch.bincount((row * width + sym).reshape(-1), minlength=counts.numel())
    return counts.view(-1, width).numpy()


def build_tables(spec: models.ModelSpec, config: QuantConfig) -> LevelTables:
    """Calibrate tables for ``config`` on ``spec``'s calibration KV and store them."""
    model = spec.identity()
    config.check_geometry(model.num_layers, model.head_dim)
    counts = _count_symbols(calibration_kv(spec), config)
    freq = rans.quantize_frequencies(counts, alphabets(config, model))
    tables_id, data = tables_file(model, config, freq, calibration_spec())
    return save_tables(tables_id, data)


def ensure_profile(model: str | models.ModelSpec) -> Profile:
    """The profile of ``model``, built or repaired from the model where needed (building
    runs the model once: seconds for tiny models, tens of seconds for SmolLM2 on 2 cores)."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    with locked(profile_path(identity).parent):
        profile = read_profile(identity)
        if profile is None or profile.calibration != calibration_spec():
            levels = paper_levels(identity.num_layers)
            calibrated, default = shipped_levels(identity)
            levels.update(calibrated)
            tables_ids = {level: build_tables(spec, config).id for level, config in levels.items()}
            profile = Profile(
                identity, levels, tables_ids, default or DEFAULT_LEVEL, calibration_spec()
            )
            profile.save()
            return profile
        _add_new_shipped_levels(spec, profile)
    for level in sorted(profile.levels):
        _ensure_tables(spec, profile, level)
    return profile


def _add_new_shipped_levels(spec: models.ModelSpec, profile: Profile) -> None:
    """Add to a profile built by an older release the shipped calibrated levels it lacks, and
    take the shipped default when it is one of them (a default the user set is kept: it names
    a level the profile has). Levels the profile has keep their configuration."""
    calibrated, default = shipped_levels(profile.model)
    added = {level: config for level, config in calibrated.items() if level not in profile.levels}
    for level, config in sorted(added.items()):
        profile.levels[level] = config
        profile.tables_ids[level] = build_tables(spec, config).id
    if default in added:
        profile.default_level = default
    if added:
        profile.save()


def _ensure_tables(spec: models.ModelSpec, profile: Profile, level: int) -> None:
    tables_id = profile.tables_ids[level]
    try:
        profile.tables(level)  # from the local directory or a provider (a chunk store)
        return
    except CodecError as exc:
        if LOCAL.path(tables_id).is_file():
            raise  # present but corrupt or foreign: say so rather than overwrite
        refused = f" ({exc})" if isinstance(exc, TablesRefused) else ""
    rebuilt = build_tables(spec, profile.config(level))
    if rebuilt.id != tables_id:
        raise CodecError(
            f"profile tables {tables_id[:16]} of {spec.name} level {level} were rebuilt here but "
            f"came out different ({rebuilt.id[:16]}: the model's forward pass is not bit-identical "
            f"on this machine); copy {tables_id}.cgtab from the machine that built the profile "
            f"into {LOCAL.describe()}{refused}"
        )


def add_level(
    model: str | models.ModelSpec, level: int, config: QuantConfig, *, make_default: bool = False
) -> Profile:
    """Calibrate tables for ``config`` and store it as ``level`` of the model's profile."""
    spec = models.resolve(model) if isinstance(model, str) else model
    profile = ensure_profile(spec)
    tables = build_tables(spec, config)
    profile.put_level(level, config, tables.id, make_default=make_default)
    return profile


def transient_profile(spec: models.ModelSpec, levels: dict[int, QuantConfig]) -> Profile:
    """A profile with only ``levels``, kept in memory (its tables are built and stored like
    any level's, by content id); the model's saved profile is not touched."""
    default = min(levels)
    ids = {level: build_tables(spec, config).id for level, config in levels.items()}
    return Profile(spec.identity(), dict(levels), ids, default, calibration_spec())


def compile_kernels(model: str | models.ModelSpec, profile: Profile) -> None:
    """Run the cachegen codec's numba kernels once at ``profile``'s default level, both forms,
    decoded into bf16 and float32, so that their compiled code is in numba's cache (beside the
    package) before a server's first request needs it: compiling them takes minutes on a
    2-core CPU."""
    from cachegen.codec import decode, get_codec
    from cachegen.codec.bitstream import FORMS
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(model)
    ids = tokenizer(workload.text("tables")[: 24 * CHUNK_TOKENS])["input_ids"][: 2 * CHUNK_TOKENS]
    kv = extract_kv(spec, token_ids=torch.tensor(ids, dtype=torch.int64))
    codec = get_codec("cachegen", profile=profile)
    for form in FORMS:
        blob = codec.encode(kv, profile.default_level, form=form)
        for dtype in (torch.bfloat16, torch.float32):
            decode(blob, out_dtype=dtype)


def codec_for(name: str, model: str | models.ModelSpec, **options):
    """Codec ``name`` for ``model``, the model's profile (``kvtc``: its basis; ``tcq``: its
    model file) built first if
    it needs one (``cachegen.codec.get_codec`` only loads them)."""
    from cachegen.codec import get_codec

    if name == "kvtc":
        return get_codec(name, basis=ensure_kvtc_basis(model), **options)
    if name == "tcq":
        return get_codec(name, tcq=ensure_tcq_model(model), **options)
    if name != "cachegen":
        return get_codec(name, **options)
    return get_codec(name, profile=ensure_profile(model), **options)


# ---- the KVTC basis -------------------------------------------------------------------------


def kvtc_calibration_spec() -> dict:
    """What a KVTC basis is fitted on; recorded in the basis and its reference."""
    return {
        "source": "pydoc_data.topics",
        "split": KVTC_CALIBRATION_SPLIT,
        "text_sha256": hashlib.sha256(workload.text(KVTC_CALIBRATION_SPLIT).encode()).hexdigest(),
        "max_tokens": KVTC_CALIBRATION_TOKENS,
        "skip_tokens": kvtc.EXACT_TOKENS,
        "keys": "pre-RoPE",
        "levels": {str(k): v for k, v in kvtc.LEVELS.items()},
    }


def fit_kvtc_basis(spec: models.ModelSpec) -> TransformBasis:
    """Fit the per-layer PCA bases (keys turned back to pre-RoPE) and every level's bit
    allocation on the ``calibrate`` split's KV; the first ``kvtc.EXACT_TOKENS`` tokens, stored
    exactly by the codec, are left out of the fit."""
    from cachegen.extract import extract_kv, load_model

    _, tokenizer, spec = load_model(spec)
    ids = tokenizer(workload.text(KVTC_CALIBRATION_SPLIT))["input_ids"][:KVTC_CALIBRATION_TOKENS]
    kv = extract_kv(spec, token_ids=torch.tensor(ids, dtype=torch.int64)[: spec.max_positions])
    thetas = models.rope_thetas(spec.config)
    skip = kvtc.EXACT_TOKENS
    keys = kv.keys[:, :, skip:].to(torch.float32)
    if any(thetas):
        keys = rotate_layer_keys(keys, skip, thetas, inverse=True)
    values = kv.values[:, :, skip:].to(torch.float32)
    L, H, n, D = keys.shape
    fits = [
        [
            fit_pca(x[layer].permute(1, 0, 2).reshape(n, H * D).double().numpy())
            for x in (keys, values)
        ]
        for layer in range(L)
    ]
    mean, components, variances = (
        np.array([[f[i] for f in layer_fits] for layer_fits in fits], dtype=np.float32)
        for i in range(3)
    )
    bits = np.array(
        [
            [
                [allocate_bits(v, round(budget * H * D)) for v in layer_vars]
                for layer_vars in variances
            ]
            for budget in kvtc.LEVELS.values()
        ],
        dtype=np.uint8,
    )
    return TransformBasis(
        spec.identity(),
        kvtc_calibration_spec(),
        tuple(thetas),
        dict(kvtc.LEVELS),
        mean,
        components,
        variances,
        bits,
    )


def ensure_kvtc_basis(model: str | models.ModelSpec) -> TransformBasis:
    """The model's KVTC basis, fitted and stored on first use (or when it was fitted on other
    text); a stored basis is read and checked like any."""
    from cachegen.codec.transform import find_basis

    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    with locked(profile_path(identity).parent):
        ref = kvtc.read_kvtc_basis_ref(identity)
        if ref is not None and ref["calibration"] == kvtc_calibration_spec():
            return find_basis(ref["basis"], identity)
        basis = save_basis(fit_kvtc_basis(spec))
        kvtc.write_kvtc_basis_ref(basis)
        return basis


# ---- the tcq model --------------------------------------------------------------------------


def tcq_calibration_spec(
    levels: dict[int, float] | None = None, spec: models.ModelSpec | None = None
) -> dict:
    """What a tcq model (of ``spec``) is fitted on; recorded in the model file and its
    reference."""
    return {
        "basis": kvtc_calibration_spec(),
        "levels": {str(k): v for k, v in (levels or tcq.LEVELS).items()},
        "radius_margin": TCQ_RADIUS_MARGIN,
        "query_rows": TCQ_QUERY_ROWS,
        "layer_exponent": tcq_layer_exponent(spec),
        "weights": "attention output error per unit of component error",
        "frame_choices": {
            "offset_units": tcq.OFFSET_UNITS,
            "family_shapes": list(tcq.FAMILY_SHAPES),
            "family_scales": [tcq.FAMILY_SCALES, *tcq.FAMILY_SCALE_RANGE],
        },
    }


TCQ_RADIUS_MARGIN = 1.5  # alphabet radius over the largest calibration coefficient
TCQ_QUERY_ROWS = 256  # calibration tokens whose queries weigh the components
# An error is weighed relative to the residual stream's energy at its layer to this power:
# 1 treats errors as relative to the layer's input, 0 as relative to the final residual.
TCQ_LAYER_EXPONENT = 1.0
# ... other than 1 for these models, each chosen among 0, 0.5 and 1 by the KL of levels 23-25
# on the calibration windows of `cachegen calibrate` (docs/codec.md, "Gemma 3's tcq calibration")
TCQ_LAYER_EXPONENTS = {"gemma3-270m": 0.5}


def tcq_layer_exponent(spec: models.ModelSpec | None) -> float:
    return TCQ_LAYER_EXPONENTS.get(spec.name, TCQ_LAYER_EXPONENT) if spec else TCQ_LAYER_EXPONENT


TCQ_STEP_SEARCH = 14  # bisection steps that find a level's step for its bits per element
TCQ_STEP_SEARCH_STRIDE = 4  # ... on every 4th calibration token


def _decoder_layers(hf_model) -> list | None:
    """The model's decoder layers, if laid out like Llama/Qwen2/Gemma 3 (``self_attn`` with
    ``q_proj`` and ``o_proj``); None otherwise."""
    layers = getattr(getattr(hf_model, "model", None), "layers", None)
    if layers is None or not all(
        hasattr(getattr(layer, "self_attn", None), name)
        for layer in layers
        for name in ("q_proj", "o_proj")
    ):
        return None
    return list(layers)


def _sandwich(layer) -> bool:
    """Gemma-style layers normalize the attention output before adding it to the residual."""
    return hasattr(layer, "pre_feedforward_layernorm")


@dataclass
class _LayerStats:
    """What one layer's component weights need from the calibration pass."""

    queries: torch.Tensor  # [query heads, rows, head_dim] pre-RoPE queries of sampled tokens
    positions: torch.Tensor  # [rows] their positions
    scale: float  # mean squared norm of what the attention's error is relative to


def _attention_stats(hf_model, spec: models.ModelSpec, ids: torch.Tensor, skip: int, rows: int):
    """``(kv, stats)``: the KV of ``ids`` and each layer's :class:`_LayerStats` (None for a
    model whose layers are not recognised). ``rows`` tokens from ``skip`` on, evenly spaced,
    keep their queries."""
    from cachegen.extract import extract_kv

    layers = _decoder_layers(hf_model)
    if layers is None:
        return extract_kv(spec, token_ids=ids), None
    n, D = len(ids), spec.identity().head_dim
    positions = torch.unique(torch.linspace(skip, n - 1, rows).round().to(torch.int64))
    captured: dict[tuple[int, str], torch.Tensor] = {}

    def energy(x: torch.Tensor) -> torch.Tensor:
        return (x.detach().to(torch.float64)[0, skip:] ** 2).sum(dim=-1).mean()

    def sampled_queries(x: torch.Tensor) -> torch.Tensor:
        """[heads, rows, D] from q_proj's [1, n, heads * D] or q_norm's [1, heads, n, D]."""
        x = x.detach().float()[0]
        if x.dim() == 3:
            return x[:, positions]
        return x.reshape(n, -1, D)[positions].permute(1, 0, 2)

    def keep(i: int, what: str, fn):
        def hook(module, args, *rest):
            x = rest[-1] if what != "residual" else (args[0] if args else rest[0]["hidden_states"])
            captured[i, what] = fn(x)

        return hook

    handles = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        q_source = getattr(attn, "q_norm", None) or attn.q_proj
        handles.append(q_source.register_forward_hook(keep(i, "q", sampled_queries)))
        handles.append(
            layer.register_forward_pre_hook(keep(i, "residual", energy), with_kwargs=True)
        )
        if _sandwich(layer):
            handles.append(attn.o_proj.register_forward_hook(keep(i, "o", energy)))
            handles.append(
                layer.post_attention_layernorm.register_forward_hook(keep(i, "normed", energy))
            )
    try:
        kv = extract_kv(spec, token_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    stats = []
    for i, layer in enumerate(layers):
        scale = float(captured[i, "residual"])
        if _sandwich(layer):  # an error relative to the attention output, then renormalized
            scale *= float(captured[i, "o"]) / float(captured[i, "normed"])
        stats.append(_LayerStats(captured[i, "q"], positions, scale))
    return kv, stats


def _attention_probabilities(
    queries: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, scaling: float, window
) -> torch.Tensor:
    """Attention of post-RoPE ``queries`` [rows, D] at ``positions`` over ``keys`` [n, D]."""
    scores = scaling * queries @ keys.T
    t = torch.arange(keys.shape[0])[None, :]
    hidden = t > positions[:, None]
    if window:
        hidden |= t <= positions[:, None] - window
    return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)


def _layer_weights(
    layer_module,
    stats: _LayerStats,
    keys: torch.Tensor,
    values: torch.Tensor,
    theta: float,
    window,
    components: np.ndarray,
    exponent: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Key and value component weights [C] of one layer: the expected squared error each
    unit of a component's quantization error puts into the attention output (after the
    output projection, relative to ``stats.scale`` to the power ``exponent``), averaged over
    the sampled queries.

    A value error at token ``t`` reaches head ``h``'s output as ``a_t W_o^h dv``; a key error
    moves logit ``t`` by ``s q . dk`` and the output by ``a_t s (q . dk) W_o^h (v_t - o)``.
    Rotary angles mix the two channels of each pair (``d``, ``d + D/2``), so for the keys
    each channel takes its pair's mean query energy. Tokens stored exactly do not count."""
    attn = layer_module.self_attn
    kv_heads, n, D = keys.shape
    heads = stats.queries.shape[0]
    group = heads // kv_heads
    scaling = float(getattr(attn, "scaling", D**-0.5))
    o_proj = attn.o_proj.weight.detach().to(torch.float32)
    q_pre = stats.queries.float()
    q_post = q_pre
    if theta:
        cos, sin = rotary_cos_sin(0, n, D, theta)
        q_post = apply_rotary(q_pre, cos[stats.positions], sin[stats.positions])
    key_energy = torch.zeros(kv_heads, D, dtype=torch.float64)
    value_gram = torch.zeros(kv_heads, D, D, dtype=torch.float64)
    for h in range(heads):
        g = h // group
        w_h = o_proj[:, h * D : (h + 1) * D]
        gram = w_h.T @ w_h
        a = _attention_probabilities(q_post[h], stats.positions, keys[g], scaling, window)
        a2 = a**2
        a2[:, : tcq.EXACT_TOKENS] = 0
        v = values[g]
        mixed = a @ v  # [rows, D]: the head's output before the projection
        v_gram = v @ gram
        spread = (v_gram * v).sum(-1)[None, :] - 2 * mixed @ v_gram.T
        spread += ((mixed @ gram) * mixed).sum(-1)[:, None]
        sensitivity = scaling**2 * (a2 * spread.clamp_min(0)).sum(-1)  # [rows]
        energy = (sensitivity[:, None] * q_pre[h] ** 2).mean(0).double()
        if theta:
            pair = (energy[: D // 2] + energy[D // 2 :]) / 2
            energy = torch.cat([pair, pair])
        key_energy[g] += energy
        value_gram[g] += a2.sum(-1).mean().double() * gram.double()
    u = components.reshape(2, -1, kv_heads, D)
    key_w = (u[0] ** 2).reshape(-1, kv_heads * D) @ key_energy.reshape(-1).numpy()
    value_w = np.einsum("igd,gde,ige->i", u[1], value_gram.numpy(), u[1])
    scale = stats.scale**exponent
    return key_w / scale, value_w / scale


def _component_weights(
    hf_model, kv: KVCache, stats, basis: TransformBasis, exponent: float
) -> np.ndarray:
    """Weights [L, 2, C], scaled together so that their variance-weighted mean is 1 (all ones
    for a model whose layers are not recognised)."""
    L, _, C = basis.variances.shape
    if stats is None:
        return np.ones((L, 2, C), dtype=np.float32)
    layers = _decoder_layers(hf_model)
    weights = np.zeros((L, 2, C), dtype=np.float64)
    windows = kv.windows or (None,) * L
    for layer in range(L):
        weights[layer] = _layer_weights(
            layers[layer],
            stats[layer],
            kv.keys[layer].float(),
            kv.values[layer].float(),
            basis.rope_thetas[layer],
            windows[layer],
            basis.components[layer].astype(np.float64),
            exponent,
        )
    var = basis.variances.astype(np.float64)
    weights *= var.sum() / (weights * var).sum()
    return np.maximum(weights, 1e-12).astype(np.float32)


def _level_tables(
    coefficients: list[list[np.ndarray]], weights: np.ndarray, steps: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """Radii and steps [L, 2, C] and the frequency tables of the kept components (in (layer,
    K/V, component) order) of one level from the calibration coefficients [L][2] ([tokens,
    C]). A component whose calibration range needs a radius above ``tcq.MAX_RADIUS`` gets a
    coarser step instead of clipping."""
    L, _, C = weights.shape
    radius = np.zeros((L, 2, C), dtype=np.uint8)
    step = np.zeros((L, 2, C), dtype=np.float32)
    tables = []
    width = 2 * tcq.MAX_RADIUS + 1
    for layer in range(L):
        for k in range(2):
            top = TCQ_RADIUS_MARGIN * np.abs(coefficients[layer][k]).max(axis=0)
            step[layer, k] = np.maximum(steps[k] / np.sqrt(weights[layer, k]), top / tcq.MAX_RADIUS)
            y = coefficients[layer][k] / step[layer, k]
            r = np.clip(np.round(TCQ_RADIUS_MARGIN * np.abs(y).max(axis=0)), 0, tcq.MAX_RADIUS)
            radius[layer, k] = r
            kept = np.flatnonzero(r)
            if not len(kept):
                continue
            rk = r[kept].astype(np.int64)
            sym = np.clip(np.round(y[:, kept]), -rk, rk).astype(np.int64) + rk
            flat = (np.arange(len(kept)) * width)[None, :] + sym
            counts = np.bincount(flat.reshape(-1), minlength=len(kept) * width)
            freq = rans.quantize_frequencies(counts.reshape(len(kept), width), 2 * rk + 1)
            tables.extend(freq[j, : 2 * rk[j] + 1] for j in range(len(kept)))
    return radius, step, tables


def _calibration_bits(coefficients: list[list[np.ndarray]], steps: np.ndarray) -> float:
    """Bits per element the calibration coefficients cost with ``steps`` [L, 2, C] under
    tables fitted to them (their empirical entropy; dropped components cost nothing)."""
    total = elements = 0.0
    for layer, pair in enumerate(coefficients):
        for k, y in enumerate(pair):
            sym = np.round(y / steps[layer, k]).astype(np.int64)
            sym -= sym.min(axis=0)
            width = int(sym.max()) + 1
            counts = np.bincount(
                (sym + np.arange(sym.shape[1]) * width).reshape(-1), minlength=sym.shape[1] * width
            ).reshape(sym.shape[1], width)
            p = counts[counts > 0] / len(y)
            total -= float(np.sum(counts[counts > 0] * np.log2(p)))
            elements += y.size
    return total / elements


def _step_for_bits(coefficients, weights: np.ndarray, bits: float) -> float:
    """The step (for keys and values alike: the weights put both in one unit) at which the
    calibration coefficients cost ``bits`` per element, by bisection on its logarithm."""
    low, high = -12.0, 12.0
    root = np.sqrt(weights.astype(np.float64))
    sample = [[y[::TCQ_STEP_SEARCH_STRIDE] for y in pair] for pair in coefficients]
    for _ in range(TCQ_STEP_SEARCH):
        mid = (low + high) / 2
        if _calibration_bits(sample, 2.0**mid / root) > bits:
            low = mid
        else:
            high = mid
    return float(2.0**high)


def fit_tcq_model(
    spec: models.ModelSpec,
    levels: dict[int, float] | None = None,
    *,
    basis: TransformBasis | None = None,
    unit_weights: bool = False,
) -> tcq.TcqModel:
    """Fit the tcq model of ``spec`` on the ``calibrate`` split: the KVTC basis, the component
    weights, and for each level (``levels``: id -> bits per element on the calibration text;
    default ``tcq.LEVELS``) the step that costs those bits, its radii and rANS tables from
    the histograms of the calibration coefficients.

    For ablations (``cachegen.lab.quality.tcq_ablation``): ``basis`` replaces the KVTC basis
    (the weights are computed for it), ``unit_weights`` gives every component the weight 1
    (one step for all); the model's calibration records either."""
    from cachegen.extract import load_model

    levels = dict(sorted((levels or tcq.LEVELS).items()))  # the file keeps levels in order
    calibration = tcq_calibration_spec(levels, spec)
    if basis is None:
        basis = ensure_kvtc_basis(spec)
    else:
        calibration["basis"] = basis.calibration
    hf_model, tokenizer, spec = load_model(spec)
    ids = tokenizer(workload.text(KVTC_CALIBRATION_SPLIT))["input_ids"][:KVTC_CALIBRATION_TOKENS]
    ids = torch.tensor(ids, dtype=torch.int64)[: spec.max_positions]
    skip = kvtc.EXACT_TOKENS
    kv, stats = _attention_stats(hf_model, spec, ids, skip, TCQ_QUERY_ROWS)
    identity = spec.identity()
    if unit_weights:
        weights = np.ones(basis.variances.shape, dtype=np.float32)
        calibration["weights"] = "none: every component weighs 1"
    else:
        weights = _component_weights(hf_model, kv, stats, basis, calibration["layer_exponent"])
    keys = kv.keys[:, :, skip:].to(torch.float32)
    if any(basis.rope_thetas):
        keys = rotate_layer_keys(keys, skip, basis.rope_thetas, inverse=True)
    values = kv.values[:, :, skip:].to(torch.float32)
    L, H, n, D = keys.shape
    coefficients = [
        [
            (x[layer].permute(1, 0, 2).reshape(n, H * D).numpy() - basis.mean[layer, k])
            @ basis.components[layer, k].T
            for k, x in enumerate((keys, values))
        ]
        for layer in range(L)
    ]
    steps_of, radii, steps, tables = {}, [], [], []
    for level, bits in levels.items():
        step = _step_for_bits(coefficients, weights, bits)
        steps_of[level] = (step, step)
        radius, level_steps, level_tables = _level_tables(coefficients, weights, steps_of[level])
        radii.append(radius)
        steps.append(level_steps)
        tables.extend(level_tables)
    freq = np.concatenate(tables).astype(np.uint16) if tables else np.zeros(0, np.uint16)
    return tcq.TcqModel(
        identity,
        calibration,
        basis.rope_thetas,
        steps_of,
        basis.mean,
        basis.components,
        weights,
        np.stack(radii),
        np.stack(steps),
        freq,
        tcq.family_weights(),
    )


def ensure_tcq_model(model: str | models.ModelSpec) -> tcq.TcqModel:
    """The model's tcq model, fitted and stored on first use (or when it was fitted on other
    text or for other levels); a stored one is read and checked like any."""
    spec = models.resolve(model) if isinstance(model, str) else model
    identity = spec.identity()
    ref = tcq.read_tcq_ref(identity)
    if ref is not None and ref["calibration"] == tcq_calibration_spec(spec=spec):
        return tcq.find_tcq_model(ref["model_file"], identity)
    fitted = fit_tcq_model(spec)
    with locked(profile_path(identity).parent):
        saved = tcq.save_tcq_model(fitted)
        tcq.write_tcq_ref(saved)
        return saved
