"""What both Triton attention kernels share (:mod:`.triton_decode`, :mod:`.triton_prefill`):
the launch checks, the addressing of a tile of tokens in either cache, the load that
dequantizes a K or V tile in registers, and the online-softmax step.

A tile's tokens ``pos`` live at (int64 offsets; loads masked by ``t_mask``):

    PAGED:       row = table[b, pos // BLOCK] (a block),  tok = pos % BLOCK
    contiguous:  row = table[b] (the sequence's slot),    tok = pos
    offset in a tensor X = row · stride_X_row + tok · stride_X_tok   (K, V or a scale view)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

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


@dataclass(frozen=True)
class Launch:
    """What both kernels' launches derive alike from their tensors (see :func:`prepare`)."""

    quant: int  # QUANT: 0 unquantized, 1 head scales, 2 per-token scales
    scale: float  # softmax scale
    g: int  # query heads per KV head
    d_pad: int  # head_dim padded to a power of two (>= 16)
    table: torch.Tensor  # 2-D: [B, blocks] (paged) or [B, 1] slots
    precision: str  # tl.dot's input_precision
    dot_fp32: bool  # feed the dots fp32 (the interpreter's 16-bit tl.dot is wrong)
    scale_args: tuple  # K_SCALE, V_SCALE (``placeholder`` where unused)
    kv_args: tuple  # K's, V's and the scale views' strides, then the table's


def prepare(q, k, v, table, placeholder, *, block, paged, window, kv_scales, scale) -> Launch:
    """Validate a launch's tensors (either kernel) and derive what both kernels take alike:
    the arguments after q's (and the output's) strides are ``kv_args``, in this order:
    k (seq, tok, head), v (seq, tok, head), per-token scales (K seq, tok, V seq, tok), table."""
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
    quant, ks, vs = _check_scales(q, k, v, kv_scales)
    d = q.shape[-1]
    table = table if table.dim() == 2 else table.view(-1, 1)
    strides = [x.stride(i) if quant == 2 else 0 for x in (ks, vs) for i in (0, 1)]
    return Launch(
        quant=quant, scale=1.0 / math.sqrt(d) if scale is None else float(scale),
        g=hq // hk, d_pad=max(16, triton.next_power_of_2(d)), table=table,
        precision="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter computes 16-bit tl.dot wrongly on the CPU (3.6 and 3.9: errors
        # of 1e10), so interpreted runs feed the dots fp32; compiled kernels the native dtype
        dot_fp32=isinstance(tile_rows, InterpretedFunction) and q.dtype != torch.float32,
        scale_args=(placeholder if ks is None else ks, placeholder if vs is None else vs),
        kv_args=(k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
                 *strides, table.stride(0)),
    )  # fmt: skip


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
