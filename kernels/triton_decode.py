"""Triton split-K decode over either cache: one kernel, two addressing modes, then a combine.

Program (b, h, p) handles sequence b, KV head h (its G query heads together) and partition p
of the sequence's tiles; it keeps a running max m, sum l and accumulator O (online softmax)
and writes the partial (m, l, O). A second kernel merges partitions with the seed's rescaling:

    M = max_p m_p;   w_p = e^(m_p − M);   O = Σ_p w_p·O_p / Σ_p w_p·l_p

Addressing of token ``pos`` of sequence b (int64 offsets; loads masked by ``pos < len``):

    PAGED:       KV + table[b, pos // BLOCK]·stride_blk + (pos % BLOCK)·stride_tok + h·stride_h
    contiguous:  KV + slot[b]·stride_seq          + pos·stride_tok            + h·stride_h

so nothing past a sequence's length is ever read (unmapped pages would fault).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _decode_partial(
    Q, K, V, TABLE, LENS, M_OUT, L_OUT, O_OUT, scale,
    stride_qb, stride_qh,
    stride_kseq, stride_ktok, stride_kh,
    stride_vseq, stride_vtok, stride_vh,
    stride_tb,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK: tl.constexpr, PART_TILES: tl.constexpr, NUM_PARTS: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    seq_len = tl.load(LENS + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, BLOCK)
    g_mask = offs_g < G
    d_mask = offs_d < D
    qh = h * G + offs_g
    q_ptr = Q + b.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * scale
    m_i = tl.full([G_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    n_tiles = tl.cdiv(seq_len, BLOCK)
    first = p * PART_TILES
    last = tl.minimum(first + PART_TILES, n_tiles)
    if PAGED:
        row_k = 0
        row_v = 0
    else:
        slot = tl.load(TABLE + b * stride_tb).to(tl.int64)
        row_k = slot * stride_kseq
        row_v = slot * stride_vseq
    for tile in range(first, last):
        pos = tile * BLOCK + offs_t
        t_mask = pos < seq_len
        if PAGED:
            blk = tl.load(TABLE + b * stride_tb + tile).to(tl.int64)
            k_off = blk * stride_kseq + offs_t[:, None] * stride_ktok
            v_off = blk * stride_vseq + offs_t[:, None] * stride_vtok
        else:
            k_off = row_k + pos[:, None].to(tl.int64) * stride_ktok
            v_off = row_v + pos[:, None].to(tl.int64) * stride_vtok
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(K + k_off + h * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [G_PAD, BLOCK]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        pexp = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pexp, axis=1)
        v = tl.load(V + v_off + h * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.sum(pexp[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new
    row = (b * (G * tl.num_programs(1)) + qh).to(tl.int64) * NUM_PARTS + p
    tl.store(M_OUT + row, m_i, mask=g_mask)
    tl.store(L_OUT + row, l_i, mask=g_mask)
    o_ptr = O_OUT + row[:, None] * D_PAD + offs_d[None, :]
    tl.store(o_ptr, acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _combine(
    M_IN, L_IN, O_IN, OUT, stride_ob, stride_oh,
    D: tl.constexpr, D_PAD: tl.constexpr, NUM_PARTS: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_p = tl.arange(0, P_PAD)
    offs_d = tl.arange(0, D_PAD)
    p_mask = offs_p < NUM_PARTS
    row = (b * tl.num_programs(1) + hq).to(tl.int64) * NUM_PARTS + offs_p
    m = tl.load(M_IN + row, mask=p_mask, other=-1e30)
    l_p = tl.load(L_IN + row, mask=p_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.exp(m - m_max)
    denom = tl.sum(w * l_p, axis=0)
    o = tl.load(O_IN + row[:, None] * D_PAD + offs_d[None, :], mask=p_mask[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, axis=0) / denom
    out_ptr = OUT + b.to(tl.int64) * stride_ob + hq * stride_oh + offs_d
    tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=offs_d < D)


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only in interpreter mode."""
    return device.type == "cuda" or isinstance(_decode_partial, InterpretedFunction)


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    *,
    paged: bool,
    block: int,
    scale: float | None = None,
    part_tiles: int = 16,
) -> torch.Tensor:
    """Split-K decode. q: ``[B, N_Q, d_h]``; lens: ``[B]`` int32 (each ≥ 1).

    paged: k, v ``[num_blocks, block, N_KV, d_h]``, table ``[B, max_blocks]`` int32.
    contiguous: k, v ``[S, L, N_KV, d_h]`` (any strides, last dim contiguous), table ``[B]``
    int32 slot ids; ``block`` is then just the tile size. Returns ``[B, N_Q, d_h]``, q's dtype.
    """
    b, hq, d = q.shape
    hk = k.shape[2]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("the last (head_dim) dimension of q, k and v must be contiguous")
    if block & (block - 1):
        raise ValueError(f"block size must be a power of two, got {block}")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g, d_pad = hq // hk, triton.next_power_of_2(d)
    max_len = int(lens.max()) if b else 0
    num_parts = max(1, triton.cdiv(triton.cdiv(max_len, block), part_tiles))
    dev = q.device
    m = torch.empty((b, hq, num_parts), dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    o = torch.empty((b, hq, num_parts, d_pad), dtype=torch.float32, device=dev)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=dev)
    if b == 0:
        return out
    table = table if table.dim() == 2 else table.view(-1, 1)
    _decode_partial[(b, hk, num_parts)](
        q, k, v, table, lens, m, lsum, o, scale,
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        table.stride(0),
        G=g, G_PAD=max(2, triton.next_power_of_2(g)), D=d, D_PAD=d_pad,
        BLOCK=block, PART_TILES=part_tiles, NUM_PARTS=num_parts, PAGED=paged,
    )  # fmt: skip
    _combine[(b, hq)](
        m, lsum, o, out, out.stride(0), out.stride(1),
        D=d, D_PAD=d_pad, NUM_PARTS=num_parts, P_PAD=max(2, triton.next_power_of_2(num_parts)),
    )  # fmt: skip
    return out
