"""Quantized K/V storage (FP8 e4m3 / e5m2, INT8): the scale rules, quantize on write,
dequantize on read, and the stored token row. Pure functions of tensors.

Two scale granularities (``KVSpec.kv_granularity``):

- ``"head"`` (vLLM's per-tensor scales, refined by head): one static scale per layer, K or V,
  and KV head, part of the spec (``KVSpec.kv_scales``); a cache, hand-off peer or tier file
  with other scales is another layout (never mixed).
- ``"token"`` (KIVI-style, per token and head): each token's scale is computed as it is
  written (s = amax over d_h / q_max) and stored **in the token's own row**, after its heads,
  so a page carries its scales: every path that moves pages (fork/CoW copies, swap, hand-off,
  prefix tiers, sleep) moves them with it, by construction.

    stored = saturate(x / s)       saturate: clamp to ±q_max, then cast (int8: round to
    x̂      = stored · s            nearest first); q_max 448 (e4m3), 57344 (e5m2), 127 (int8)

A stored row (one token, one layer, K or V; ``R = KVSpec.row_elems`` one-byte elements):

    | head 0: d_h | head 1: d_h | ... | head N_KV−1 | s_0 … s_{N_KV−1} (fp32) | pad |
    0                                  N_KV·d_h                                  R
    (head granularity and unquantized K/V: no scales, R = N_KV·d_h)

The scales are padded to 16 bytes so every row starts 16-byte aligned (vector loads).

FP8 keeps a relative precision (3 or 2 mantissa bits) over a wide range, so s = 1 serves
activations of ordinary size; INT8 is uniform and needs calibrated head scales
(:func:`vmcache.hf.calibrate_kv_scales`) or token scales.
"""

from __future__ import annotations

import torch

Q_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
GRANULARITIES = ("head", "token")
SCALE_ALIGN = 16  # bytes the per-token scales of a row are padded to
MIN_SCALE = torch.finfo(torch.float32).tiny  # an all-zero head gets this scale (stores zeros)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x ``[..., N_KV, d_h]`` (any float dtype), scale fp32 ``[N_KV]`` or ``[..., N_KV]`` on
    x's device → the same shape in ``dtype`` (saturating)."""
    q_max = Q_MAX[dtype]
    y = (x.float() / scale.unsqueeze(-1)).clamp_(-q_max, q_max)
    if dtype == torch.int8:
        y = y.round_()
    return y.to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x ``[..., N_KV, d_h]`` stored, scale fp32 ``[N_KV]`` or ``[..., N_KV]`` → the same
    shape in ``dtype``."""
    return (x.float() * scale.unsqueeze(-1)).to(dtype)


def token_scales(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per token and head scales of x ``[..., N_KV, d_h]``: fp32 ``[..., N_KV]``, amax / q_max
    (at least :data:`MIN_SCALE`)."""
    return (x.float().abs().amax(-1) / Q_MAX[dtype]).clamp_(min=MIN_SCALE)


def split_rows(rows: torch.Tensor, heads: int, head_dim: int):
    """Zero-copy views of stored rows ``[..., R]`` (last dim contiguous): the K or V elements
    ``[..., N_KV, d_h]`` and, when the rows carry them (R > N_KV·d_h), the per-token scales
    fp32 ``[..., N_KV]`` (else None)."""
    hd = heads * head_dim
    data = rows[..., :hd].unflatten(-1, (heads, head_dim))
    if rows.shape[-1] == hd:
        return data, None
    return data, rows[..., hd : hd + 4 * heads].view(torch.float32)


def encode_rows(x: torch.Tensor, head_scale: torch.Tensor | None, dtype: torch.dtype,
                row_elems: int) -> torch.Tensor:  # fmt: skip
    """x ``[n, N_KV, d_h]`` (compute dtype) → stored rows ``[n, row_elems]`` in ``dtype``:
    quantized with ``head_scale`` (fp32 ``[N_KV]``, head granularity), or with per-token
    scales written into each row's tail (``head_scale`` None, rows longer than N_KV·d_h), or
    unchanged (``dtype`` not quantized)."""
    n, heads, d = x.shape
    hd = heads * d
    if dtype not in Q_MAX:
        return x.reshape(n, hd)
    if row_elems == hd:
        return quantize(x, head_scale, dtype).reshape(n, hd)
    scale = token_scales(x, dtype)
    rows = torch.zeros((n, row_elems), dtype=torch.uint8, device=x.device)
    rows[:, :hd] = quantize(x, scale, dtype).reshape(n, hd).view(torch.uint8)
    rows[:, hd : hd + 4 * heads] = scale.view(torch.uint8)
    return rows.view(dtype)


def decode_rows(rows: torch.Tensor, head_scale: torch.Tensor | None, heads: int,
                head_dim: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Stored rows ``[..., R]`` → ``[..., N_KV, d_h]`` in ``dtype``: zero-copy views when not
    quantized, else dequantized copies (by the rows' own scales, else ``head_scale``)."""
    data, scale = split_rows(rows, heads, head_dim)
    if rows.dtype not in Q_MAX:
        return data
    return dequantize(data, head_scale if scale is None else scale, dtype)
