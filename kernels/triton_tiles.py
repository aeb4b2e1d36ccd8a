"""What both Triton attention kernels share (:mod:`.triton_decode`, :mod:`.triton_prefill`):
the launch checks, the addressing of a tile of tokens in either cache, the load that
dequantizes a K or V tile in registers, and the online-softmax step.

A tile's tokens ``pos`` live at (int64 offsets; loads masked by ``t_mask``):

    PAGED:       row = table[b, pos // BLOCK] (a block),  tok = pos % BLOCK
    contiguous:  row = table[b] (the sequence's slot),    tok = pos
    offset in a tensor X = row · stride_X_row + tok · stride_X_tok   (K, V or a scale view)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FULL = 2**31 - 1  # the window argument of full attention


@triton.jit
def tile_rows(TABLE, b, pos, t_mask, stride_tb, BLOCK: tl.constexpr, PAGED: tl.constexpr):
    """(row, tok), each ``[TILE]`` int64, of the tokens at ``pos`` of sequence b."""
    if PAGED:
        tab = TABLE + b.to(tl.int64) * stride_tb + pos // BLOCK
        row = tl.load(tab, mask=t_mask, other=0).to(tl.int64)
        tok = (pos % BLOCK).to(tl.int64)
    else:
        slot = tl.load(TABLE + b.to(tl.int64) * stride_tb).to(tl.int64)
        row = tl.zeros_like(pos).to(tl.int64) + slot
        tok = pos.to(tl.int64)
    return row, tok


@triton.jit
def load_tile(PTR, off, offs_d, mask, like, QUANT: tl.constexpr, DOT_FP32: tl.constexpr):
    """The ``[TILE, D_PAD]`` tile at row offsets ``off`` of PTR (a head's K or V), ready for
    a dot with ``like`` (q): FP8/INT8 converted in registers (QUANT; scales applied by the
    caller), fp32 where the interpreter needs it (DOT_FP32)."""
    x = tl.load(PTR + off[:, None] + offs_d[None, :], mask=mask, other=0.0)
    if QUANT:
        x = x.to(tl.float32).to(like.dtype)
    if DOT_FP32:
        x = x.to(tl.float32)
    return x


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax update with scores ``s`` [rows, TILE] (−inf where masked): the new
    running max, the factor that rescales what came before, the probabilities, the new sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    pexp = tl.exp(s - m_new[:, None])
    return m_new, alpha, pexp, l_i * alpha + tl.sum(pexp, axis=1)


def check_args(q, k, v, block, paged, window, kv_scales):
    """Validate a launch's tensors (either kernel); returns :func:`_check_scales`'s triple."""
    hq, hk = q.shape[-2], k.shape[2]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the last (head_dim) dimension of q, k and v must be contiguous")
    if block < 1 or (paged and block & (block - 1)):
        raise ValueError(f"block size must be a power of two, got {block}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):  # fmt: skip
        raise ValueError(f"window must be None or a positive int, got {window!r}")
    return _check_scales(q, k, v, kv_scales)


def scale_strides(quant: int, ks, vs) -> list[int]:
    """The per-token scale views' (sequence or block, token) strides; zeros otherwise."""
    return [x.stride(i) if quant == 2 else 0 for x in (ks, vs) for i in (0, 1)]


def _check_scales(q, k, v, kv_scales):
    """(QUANT, K's scales, V's scales) for a launch: 0 unquantized, 1 per head, 2 per token."""
    if kv_scales is None:
        if not (q.dtype == k.dtype == v.dtype):
            raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
        return 0, None, None
    if k.dtype != v.dtype or k.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        raise TypeError(f"quantized K/V must both be float8 or int8, got {k.dtype}, {v.dtype}")
    if isinstance(kv_scales, torch.Tensor):
        if tuple(kv_scales.shape) != (2, k.shape[2]) or kv_scales.dtype != torch.float32:
            raise TypeError(f"head kv_scales must be fp32 [2, {k.shape[2]}], got "
                            f"{kv_scales.dtype} {list(kv_scales.shape)}")  # fmt: skip
        return 1, kv_scales[0], kv_scales[1]
    ks, vs = kv_scales
    for x, ref in ((ks, k), (vs, v)):
        if (not isinstance(x, torch.Tensor) or x.dtype != torch.float32
                or tuple(x.shape) != tuple(ref.shape[:3]) or x.stride(-1) != 1):  # fmt: skip
            raise TypeError(f"per-token kv_scales must be fp32 {list(ref.shape[:3])} views with "
                            f"a contiguous last dim, got {getattr(x, 'shape', x)}")  # fmt: skip
    return 2, ks, vs
