"""Rotary position angles (NeoX "rotate half"): their cos and sin tables, shared by every
decoder that turns keys to their positions, and keys turned by them or back."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import torch


@functools.lru_cache(maxsize=16)
def _inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rotary_cos_sin(
    start: int, num_tokens: int, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[num_tokens, head_dim]`` (float32) of the NeoX rotary angles of positions
    ``start ..``; read-only views into a shared table, which every chunk of a load slices
    instead of recomputing the angles for each chunk."""
    end = start + num_tokens
    cos, sin = _rotary_table(head_dim, theta, _table_positions(end))
    return cos[start:end], sin[start:end]


def rotary_tables(
    head_dim: int, thetas: tuple[float, ...], end: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """cos and sin ``[len(thetas) * P, head_dim]`` (float32, read-only) of positions ``0 .. P
    - 1`` under each of ``thetas`` in turn, and ``P``, past ``end``: position ``p`` under
    ``thetas[i]`` is row ``i * P + p``. One shared table per set of thetas, which a decoder
    indexes instead of copying each frame's rows out."""
    positions = _table_positions(end)
    return (*_stacked_tables(head_dim, thetas, positions), positions)


def _table_positions(end: int) -> int:
    return 1 << max(12, (end - 1).bit_length())


@functools.lru_cache(maxsize=4)
def _stacked_tables(
    head_dim: int, thetas: tuple[float, ...], positions: int
) -> tuple[np.ndarray, np.ndarray]:
    # one theta shares rotary_cos_sin's table; several get one of their own, not a copy of
    # each theta's table besides it (long contexts' tables run to hundreds of MB)
    if len(thetas) == 1:
        cos, sin = _rotary_table(head_dim, thetas[0], positions)
    else:
        tables = [_cos_sin(head_dim, theta, positions) for theta in thetas]
        cos, sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
    cos, sin = cos.numpy(), sin.numpy()
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


@functools.lru_cache(maxsize=8)
def _rotary_table(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _cos_sin(head_dim, theta, positions)


def _cos_sin(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions ``0 .. positions - 1``; angles are computed in float64 so
    that far positions keep their precision."""
    angles = (
        torch.arange(positions, dtype=torch.float64)[:, None]
        * _inverse_frequencies(head_dim, theta)[None, :]
    )
    angles = torch.cat([angles, angles], dim=1)
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [..., tokens, head_dim] rotated by the angles whose cos and sin are given (as
    :func:`rotary_cos_sin` makes them); a new float32 tensor."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(
        x[..., half:], sin[:, :half], value=-1
    )  # in place: faster than temporaries
    out[..., half:].addcmul_(x[..., :half], sin[:, half:])
    return out


def rotate_keys(
    x: torch.Tensor, start: int, theta: float, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate float32 keys ``[..., tokens, head_dim]`` of positions ``start ..`` by their rotary
    angles (``inverse``: back to their pre-RoPE form); returns a new tensor."""
    cos, sin = rotary_cos_sin(start, x.shape[-2], x.shape[-1], theta)
    return apply_rotary(x, cos.to(x.device), (-sin if inverse else sin).to(x.device))


def theta_runs(thetas: tuple[float, ...]) -> list[tuple[int, int, float]]:
    """``(first layer, end layer, base)`` of each run of layers that share a rotary base."""
    out: list[tuple[int, int, float]] = []
    begin = 0
    for theta, run in itertools.groupby(thetas):
        count = len(list(run))
        out.append((begin, begin + count, theta))
        begin += count
    return out


def rotate_layer_keys(
    x: torch.Tensor, start: int, thetas: tuple[float, ...], *, inverse: bool = False
) -> torch.Tensor:
    """:func:`rotate_keys` for keys ``[layers, heads, tokens, head_dim]`` whose layers have
    their own bases (``thetas``, one per layer; 0 leaves a layer as it is); a new tensor."""
    if len(set(thetas)) == 1:
        return rotate_keys(x, start, thetas[0], inverse=inverse) if thetas[0] else x.clone()
    out = x.clone()
    for a, b, theta in theta_runs(thetas):
        if theta:
            out[a:b] = rotate_keys(x[a:b], start, theta, inverse=inverse)
    return out
