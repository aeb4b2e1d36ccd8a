"""Quantized K/V storage (FP8 e4m3 / e5m2, INT8): the scale rule, quantize on write, dequantize
on read. Pure functions of tensors; the scales are part of the spec (``KVSpec.kv_scales``), so
pages stay plain arrays that forks, swaps, hand-offs, tiers and sleep move unchanged, and a
cache, hand-off peer or tier file with other scales is another layout (never mixed).

Scale rule, per layer, K or V, and KV head h (vLLM's per-tensor scales, refined by head):

    stored = saturate(x / s_h)      saturate: clamp to ±q_max, then cast (int8: round to
    x̂      = stored · s_h           nearest first); q_max 448 (e4m3), 57344 (e5m2), 127 (int8)

FP8 keeps a relative precision (3 or 2 mantissa bits) over a wide range, so s = 1 serves
activations of ordinary size; INT8 is uniform and needs calibrated scales (s = amax / 127,
:func:`vmcache.hf.calibrate_kv_scales`).
"""

from __future__ import annotations

import torch

Q_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x ``[..., N_KV, d_h]`` (any float dtype), scale ``[N_KV]`` fp32 on x's device → the
    same shape in ``dtype`` (saturating)."""
    q_max = Q_MAX[dtype]
    y = (x.float() / scale[:, None]).clamp_(-q_max, q_max)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x ``[..., N_KV, d_h]`` stored, scale ``[N_KV]`` fp32 → the same shape in ``dtype``."""
    return (x.float() * scale[:, None]).to(dtype)
