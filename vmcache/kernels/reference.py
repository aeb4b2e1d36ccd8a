"""Ground truth for every attention test: plain torch, fp32 accumulation, GQA-aware.

GQA: query head ``h`` reads KV head ``h // G`` with ``G = N_Q / N_KV``:

    q heads:  0 1 2 3 | 4 5 6 7      (N_Q = 8)
    kv heads:    0    |    1         (N_KV = 2, G = 4)
"""

from __future__ import annotations

import math

import torch


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``Tq`` positions over ``Tk`` keys (bottom-right aligned).

    q: ``[Tq, N_Q, d_h]``; k, v: ``[Tk, N_KV, d_h]`` with ``Tq <= Tk``. Returns ``[Tq, N_Q, d_h]``
    in q's dtype. Query ``i`` (position p = Tk − Tq + i) sees keys ``[0, p]``; with a sliding
    ``window`` W only ``(p − W, p]`` (transformers' convention).
    """
    tq, hq, d = q.shape
    tk, hk, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = hq // hk
    kf = k.float().repeat_interleave(g, dim=1)  # [Tk, N_Q, d]
    vf = v.float().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float() * scale, kf)
    pos = torch.arange(tq)[:, None] + (tk - tq)
    keep = torch.arange(tk)[None, :] <= pos
    if window is not None:
        keep &= torch.arange(tk)[None, :] > pos - window
    scores = scores.masked_fill(~keep.to(scores.device), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


def paged_decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The seed's online-softmax paged decode, block by block, one sequence at a time.

    q: ``[B, N_Q, d_h]``; k_pool, v_pool: ``[num_blocks, Bs, N_KV, d_h]``;
    block_table: ``[B, max_blocks]`` int; seq_lens: ``[B]`` int. Returns ``[B, N_Q, d_h]``.
    For each block: m' = max(m, max s); l = l·e^(m−m') + Σ e^(s−m'); O = O·e^(m−m') + Σ e^(s−m')·V.
    """
    nb, bs, hk, d = k_pool.shape
    b, hq, _ = q.shape
    g = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.empty_like(q)
    for i in range(b):
        n = int(seq_lens[i])
        qi = q[i].float().view(hk, g, d) * scale
        m = torch.full((hk, g), float("-inf"))
        l_sum = torch.zeros(hk, g)
        acc = torch.zeros(hk, g, d)
        for j in range(-(-n // bs)):
            blk = int(block_table[i, j])
            used = min(bs, n - j * bs)
            kb = k_pool[blk, :used].float().cpu()  # [used, hk, d]
            vb = v_pool[blk, :used].float().cpu()
            s = torch.einsum("hgd,thd->hgt", qi.cpu(), kb)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.exp(m - m_new)
            p = torch.exp(s - m_new[..., None])
            l_sum = l_sum * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + torch.einsum("hgt,thd->hgd", p, vb)
            m = m_new
        out[i] = (acc / l_sum[..., None]).reshape(hq, d).to(q.dtype)
    return out
