"""Triton prefill over either cache: causal attention of packed new tokens to everything their
sequence holds (its cached prefix and themselves), reading K/V where they live.

Program (b, m, hq) handles sequence b, query block m (BLOCK_M of its new tokens) and query
head hq (its KV head h = hq // G); it walks key tiles with an online softmax, as the decode
kernel does, and writes its rows of the packed output. The new tokens are the last q_len of
the sequence's kv_len, so query row i sits at position p_i = kv_len − q_len + i and sees keys
(p_i − W, p_i] (W = ∞ without a sliding window):

    keys:   0 ............ lo ......................... p_first ... p_last | kv_len
    block m's rows:                                     [ p_first … p_last ]
    tiles:                 | lo … lo+TILE | ... | the last tile, masked at p_last + 1 |
                           lo = max(0, p_first − W + 1): nothing before it is read

    q rows of b: starts[b] … starts[b+1]   (packed q and out [Σ q_lens, N_Q, d_h])

Addressing and quantized K/V (QUANT 1 head scales, 2 per-token scales from each token's row)
are the decode kernel's (see :mod:`vmcache.kernels.triton_decode`). Lengths, windows and the
batch are runtime arguments; the grid's query blocks come from the plan's host ``max_q``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vmcache.kernels.triton_tiles import (
    FULL,
    load_tile,
    prepare,
    softmax_step,
    tile_rows,
)

# (query rows a program holds, keys per loop iteration, warps) by q's dtype, for head_dim <= 128
# and above. fp32 dots run on FMA units: 64-row tiles spill, 32 x 32 on 8 warps do not. At 16
# bits, 64 x 64 tiles reached the 255-register ceiling with per-token scales (and spilled in
# some builds); 64 x 32 keep every case at <= 206 registers. head_dim 256 (Gemma) needs 8
# warps at 16 bits and 16 x 16 tiles at fp32 (benchmarks/compile_sm90.py)
CONFIG = {torch.float32: ((32, 32, 8), (16, 16, 8)), torch.float16: ((64, 32, 4), (64, 32, 8)),
          torch.bfloat16: ((64, 32, 4), (64, 32, 8))}  # fmt: skip


@triton.jit(do_not_specialize=["scale", "window", "stride_tb"])
def _prefill(
    Q, K, V, OUT, TABLE, LENS, STARTS, K_SCALE, V_SCALE, MASK, MASK_STARTS, scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kseq, stride_ktok, stride_kh,
    stride_vseq, stride_vtok, stride_vh,
    stride_ksseq, stride_kstok, stride_vsseq, stride_vstok,
    stride_tb,
    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, QUANT: tl.constexpr, TREE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    mb = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // G
    q_start = tl.load(STARTS + b)
    q_len = tl.load(STARTS + b + 1) - q_start
    if mb * BLOCK_M < q_len:
        if QUANT == 1:
            scale = scale * tl.load(K_SCALE + h)
        kv_len = tl.load(LENS + b)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        offs_t = tl.arange(0, TILE)
        m_mask = offs_m < q_len
        d_mask = offs_d < D
        p_q = kv_len - q_len + offs_m  # each row's position
        rows = (q_start + offs_m).to(tl.int64)
        q_ptr = Q + rows[:, None] * stride_qt + hq * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        if DOT_FP32:
            q = q.to(tl.float32)
        first = kv_len - q_len + mb * BLOCK_M
        hi = tl.minimum(first + BLOCK_M, kv_len)  # one past the block's last position
        lo = tl.maximum(first - window + 1, 0)
        m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        if TREE:  # each row's ancestors among the new tokens, a 32-bit word (bit j: token j)
            m0 = tl.load(MASK_STARTS + b)
            is_tree = (offs_m * 0 + m0) >= 0
            anc = tl.load(MASK + m0 + offs_m, mask=m_mask & is_tree, other=0)
        for tile in range(0, tl.cdiv(hi - lo, TILE)):
            pos = lo + tile * TILE + offs_t
            t_mask = pos < hi
            row, tok = tile_rows(TABLE, b, pos, t_mask, stride_tb, BLOCK, PAGED)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k = load_tile(K + h * stride_kh, row * stride_kseq + tok * stride_ktok, offs_d,
                          kv_mask, q, QUANT, DOT_FP32)  # fmt: skip
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_M, TILE]
            if QUANT == 2:
                ks = tl.load(
                    K_SCALE + row * stride_ksseq + tok * stride_kstok + h, mask=t_mask, other=0.0
                )
                s = s * ks[None, :]
            seen = (pos[None, :] <= p_q[:, None]) & (pos[None, :] > p_q[:, None] - window)
            if TREE:  # a tree's queries see the history and their ancestors among its tokens
                j = pos - (kv_len - q_len)  # the key's index among the new tokens
                bit = (anc[:, None] >> tl.maximum(j, 0)[None, :]) & 1
                seen = tl.where(is_tree[:, None], (j < 0)[None, :] | (bit != 0), seen)
            s = tl.where(seen & t_mask[None, :], s, float("-inf"))
            m_new, alpha, pexp, l_i = softmax_step(s, m_i, l_i)
            v = load_tile(V + h * stride_vh, row * stride_vseq + tok * stride_vtok, offs_d,
                          kv_mask, q, QUANT, DOT_FP32)  # fmt: skip
            acc = acc * alpha[:, None]
            if QUANT == 2:
                vs = tl.load(
                    V_SCALE + row * stride_vsseq + tok * stride_vstok + h, mask=t_mask, other=0.0
                )
                pexp = pexp * vs[None, :]
            acc = tl.dot(pexp.to(v.dtype), v, acc, input_precision=PRECISION)
            m_i = m_new
        if QUANT == 1:
            acc = acc * tl.load(V_SCALE + h)
        out = acc / tl.where(m_mask, l_i, 1.0)[:, None]  # rows past q_len: never stored
        o_ptr = OUT + rows[:, None] * stride_ot + hq * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def launches(q, k, v, table, lens, starts, *, max_q, paged, block, scale=None, window=None,
             kv_scales=None, tree_masks=None, mask_starts=None):  # fmt: skip
    """The kernel launch of :func:`prefill`, as ``(out, [(kernel, grid, args, kwargs)])``;
    the sm_90 compile test compiles exactly this. Arguments as in :func:`prefill`."""
    n, hq, d = q.shape
    L = prepare(q, k, v, table, lens, block=block, paged=paged, window=window,
                kv_scales=kv_scales, scale=scale)  # fmt: skip
    b = lens.shape[0]
    tree = tree_masks is not None
    if tree and (window is not None or mask_starts is None or tree_masks.dtype != torch.int32):
        raise ValueError("token trees need int32 ancestor rows, their mask_starts, no window")
    out = torch.empty_like(q)
    block_m, tile, warps = CONFIG.get(q.dtype, CONFIG[torch.float32])[L.d_pad > 128]
    run = (
        _prefill, (b, triton.cdiv(max(max_q, 1), block_m), hq),
        (q, k, v, out, L.table, lens, starts, *L.scale_args, tree_masks if tree else lens,
         mask_starts if tree else lens, L.scale, window or FULL,
         q.stride(0), q.stride(1), out.stride(0), out.stride(1), *L.kv_args),
        dict(G=L.g, D=d, D_PAD=L.d_pad, BLOCK_M=block_m, TILE=tile, BLOCK=block, PAGED=paged,
             PRECISION=L.precision, DOT_FP32=L.dot_fp32, QUANT=L.quant, TREE=tree,
             num_warps=warps),
    )  # fmt: skip
    return out, [run]


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    starts: torch.Tensor,
    *,
    max_q: int,
    paged: bool,
    block: int,
    scale: float | None = None,
    window: int | None = None,
    kv_scales=None,
    tree_masks: torch.Tensor | None = None,
    mask_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal prefill. q: packed ``[Σ q_lens, N_Q, d_h]``; starts: ``[B+1]`` int32 (sequence
    b's queries are rows ``starts[b] … starts[b+1]``), lens: ``[B]`` int32 kv lengths (each
    ≥ its q_len: the queries' own K/V already written), both on q's device; ``max_q``: a host
    int ≥ every q_len (sizes the grid; no device read). k, v, table, block, window and
    kv_scales as in :func:`vmcache.kernels.triton_decode.decode`. Token trees (q_len <= 32):
    ``tree_masks`` int32 ``[Σ q_len of the trees]`` (a query's ancestors as a bit field: bit
    j where it sees the tree's new token j; :func:`~vmcache.kernels.common.packed_trees`) and
    ``mask_starts`` ``[B]`` int32 (a tree's first row, −1 for a causal sequence): a tree's
    query sees the whole history and its ancestors. Returns q's shape and dtype.
    """
    out, runs = launches(q, k, v, table, lens, starts, max_q=max_q, paged=paged, block=block,
                         scale=scale, window=window, kv_scales=kv_scales,
                         tree_masks=tree_masks, mask_starts=mask_starts)  # fmt: skip
    if q.shape[0] == 0:
        return out
    for kernel, grid, args, kwargs in runs:
        kernel[grid](*args, **kwargs)
    return out
