"""The research baselines int8-zstd and KIVI-style 2-bit (their round trips with every other
codec: tests/codec/test_codec.py)."""

from __future__ import annotations

import torch

from cachegen.codec import decode, get_codec
from tests.codec.transform_support import f32


def test_int8_zstd_decodes_to_the_same_values_as_int8(kv):
    a = decode(get_codec("int8").encode(kv), out_dtype=torch.float32)
    b = decode(get_codec("int8-zstd").encode(kv), out_dtype=torch.float32)
    assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_kivi2_error_is_within_half_a_step(kv):
    x = f32(kv)
    y = f32(decode(get_codec("kivi2", group_size=32).encode(kv), out_dtype=torch.float32))
    L, H, n, D = kv.keys.shape
    k, v = x[0], x[1]
    ng = -(-n // 32)
    kp = torch.cat([k, k[:, :, -1:].expand(L, H, ng * 32 - n, D)], 2).view(L, H, ng, 32, D)
    kstep = (
        ((kp.amax(3, keepdim=True) - kp.amin(3, keepdim=True)) / 3)
        .expand(L, H, ng, 32, D)
        .reshape(L, H, ng * 32, D)[:, :, :n]
    )
    vg = v.view(L, H, n, D // 32, 32)
    vstep = (
        ((vg.amax(4, keepdim=True) - vg.amin(4, keepdim=True)) / 3)
        .expand_as(vg)
        .reshape(L, H, n, D)
    )
    # half a step, plus the fp16 rounding of the group's minimum and step
    assert torch.all((k - y[0]).abs() <= kstep * 0.51 + k.abs() * 2e-3 + 1e-3)
    assert torch.all((v - y[1]).abs() <= vstep * 0.51 + v.abs() * 2e-3 + 1e-3)
