"""Triton split-K decode over either cache: one kernel, two addressing modes, then a combine.

Program (b, h, p) handles sequence b, KV head h (its G query heads together, padded to a
tensor-core tile of 16 rows) and partition p of the sequence's tiles; it keeps a running max
m, sum l and accumulator O (online softmax) and writes the partial (m, l, O). Scores and the
weighted V sum are ``tl.dot`` products (fp32 accumulation), so the G×TILE and G×D products
live in tensor-core fragments rather than in registers. A second kernel merges partitions with
the seed's rescaling, looping over them in chunks, so the partition count is a runtime value:

    M = max_p m_p;   w_p = e^(m_p − M);   O = Σ_p w_p·O_p / Σ_p w_p·l_p

Addressing of token ``pos`` of sequence b (int64 offsets; loads masked by ``pos < len``):

    PAGED:       KV + table[b, pos // BLOCK]·stride_blk + (pos % BLOCK)·stride_tok + h·stride_h
    contiguous:  KV + slot[b]·stride_seq              + pos·stride_tok            + h·stride_h

so nothing past a sequence's length is ever read (unmapped pages would fault). With a sliding
window W (runtime; 2^31 − 1 = none) the query at position len − 1 reads keys [lo, len), lo =
max(0, len − W): the tiles start at lo itself (not at a multiple of TILE), so the pages a
window released are never touched either, and full attention (lo = 0) is the same loop:

    pos:   0 ... lo | tile 0: lo … lo+63 | tile 1 | ... | last tile, masked at len |
                    ^ lo = len − W (keys (len − 1 − W, len − 1])

Quantized K/V (FP8 e4m3 / e5m2, INT8; ``QUANT``): tiles are loaded in the storage dtype (one
byte per element: half the bytes a BF16 decode reads) and converted in registers to q's dtype
for the dots; the scales are folded in, not applied per element:

    QUANT 1, per head:   s = (q · k̂ᵀ) · scale · s_k[h]      (one scalar per program)
                         O = (Σ p · v̂) · s_v[h]             (once, on the partial accumulator)
    QUANT 2, per token:  s = (q · k̂ᵀ) · scale · s_k[t, h]   (one scale per key column)
                         O = Σ (p · s_v[t, h]) · v̂          (the probabilities scaled per row)

Per-token scales sit in each token's stored row after its heads (see vmcache.sequences.quant):
K_SCALE / V_SCALE are fp32 views addressed like K and V, by their own strides.

Compilations: shapes, dtypes and the addressing mode are compile-time; lengths, the partition
count and the batch are runtime (``do_not_specialize``), so a growing decode never recompiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from vmcache.kernels.triton_tiles import (
    FULL,
    load_tile,
    prepare,
    softmax_step,
    tile_rows,
)

TILE = 64  # tokens per loop iteration
PART_TOKENS = 1024  # tokens per split-K partition
P_CHUNK = 16  # partitions the combine merges per iteration
G_MIN = 16  # tl.dot needs at least 16 rows


@triton.jit(do_not_specialize=["scale", "num_parts", "stride_tb", "window"])
def _decode_partial(
    Q, K, V, TABLE, LENS, M_OUT, L_OUT, O_OUT, K_SCALE, V_SCALE, scale, num_parts, window,
    stride_qb, stride_qh,
    stride_kseq, stride_ktok, stride_kh,
    stride_vseq, stride_vtok, stride_vh,
    stride_ksseq, stride_kstok, stride_vsseq, stride_vstok,
    stride_tb,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    TILE: tl.constexpr, BLOCK: tl.constexpr, PART_TILES: tl.constexpr, PAGED: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, QUANT: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    if QUANT == 1:
        scale = scale * tl.load(K_SCALE + h)
    seq_len = tl.load(LENS + b)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_t = tl.arange(0, TILE)
    g_mask = offs_g < G
    d_mask = offs_d < D
    qh = h * G + offs_g
    q_ptr = Q + b.to(tl.int64) * stride_qb + qh[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [G_PAD, D_PAD]
    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([G_PAD], -1e30, dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    lo = tl.maximum(seq_len - window, 0)  # window = 2^31 − 1 for full attention: lo = 0
    n_tiles = tl.cdiv(seq_len - lo, TILE)  # tiles start at lo: nothing before it is read
    first = p * PART_TILES
    last = tl.minimum(first + PART_TILES, n_tiles)
    for tile in range(first, last):
        pos = lo + tile * TILE + offs_t
        t_mask = pos < seq_len
        row, tok = tile_rows(TABLE, b, pos, t_mask, stride_tb, BLOCK, PAGED)
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = load_tile(K + h * stride_kh, row * stride_kseq + tok * stride_ktok, offs_d, kv_mask,
                      q, QUANT, DOT_FP32)  # fmt: skip
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [G_PAD, TILE] fp32
        if QUANT == 2:
            ks = tl.load(
                K_SCALE + row * stride_ksseq + tok * stride_kstok + h, mask=t_mask, other=0.0
            )
            s = s * ks[None, :]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new, alpha, pexp, l_i = softmax_step(s, m_i, l_i)
        v = load_tile(V + h * stride_vh, row * stride_vseq + tok * stride_vtok, offs_d, kv_mask,
                      q, QUANT, DOT_FP32)  # fmt: skip
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
    out_row = (b * (G * tl.num_programs(1)) + qh).to(tl.int64) * num_parts + p
    tl.store(M_OUT + out_row, m_i, mask=g_mask)
    tl.store(L_OUT + out_row, l_i, mask=g_mask)
    o_ptr = O_OUT + out_row[:, None] * D_PAD + offs_d[None, :]
    tl.store(o_ptr, acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_parts"])
def _combine(
    M_IN, L_IN, O_IN, OUT, stride_ob, stride_oh, num_parts,
    D: tl.constexpr, D_PAD: tl.constexpr, P_CHUNK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    hq = tl.program_id(1)
    offs_c = tl.arange(0, P_CHUNK)
    offs_d = tl.arange(0, D_PAD)
    base = (b * tl.num_programs(1) + hq).to(tl.int64) * num_parts
    m_max = tl.full([P_CHUNK], -1e30, dtype=tl.float32)
    for p0 in range(0, num_parts, P_CHUNK):
        offs_p = p0 + offs_c
        m = tl.load(M_IN + base + offs_p, mask=offs_p < num_parts, other=-1e30)
        m_max = tl.maximum(m_max, m)
    m_all = tl.max(m_max, axis=0)
    denom = tl.zeros([P_CHUNK], dtype=tl.float32)
    acc = tl.zeros([P_CHUNK, D_PAD], dtype=tl.float32)
    for p0 in range(0, num_parts, P_CHUNK):
        offs_p = p0 + offs_c
        p_mask = offs_p < num_parts
        m = tl.load(M_IN + base + offs_p, mask=p_mask, other=-1e30)
        l_p = tl.load(L_IN + base + offs_p, mask=p_mask, other=0.0)
        o = tl.load(O_IN + (base + offs_p)[:, None] * D_PAD + offs_d[None, :],
                    mask=p_mask[:, None], other=0.0)  # fmt: skip
        w = tl.exp(m - m_all)
        denom += w * l_p
        acc += w[:, None] * o
    out = tl.sum(acc, axis=0) / tl.sum(denom, axis=0)
    out_ptr = OUT + b.to(tl.int64) * stride_ob + hq * stride_oh + offs_d
    tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=offs_d < D)


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only in interpreter mode."""
    return device.type == "cuda" or isinstance(_decode_partial, InterpretedFunction)


def num_partitions(max_len: int, part_tokens: int = PART_TOKENS) -> int:
    """Split-K partitions for a batch whose longest sequence holds ``max_len`` tokens."""
    return max(1, -(-max(max_len, 1) // part_tokens))


def launches(q, k, v, table, lens, *, max_len, paged, block, scale=None,
             part_tokens=PART_TOKENS, window=None, kv_scales=None):  # fmt: skip
    """The two kernel launches of :func:`decode`, as ``(out, [(kernel, grid, args, kwargs)])``;
    the sm_90 compile test compiles exactly these. Arguments as in :func:`decode`."""
    b, hq, d = q.shape
    hk = k.shape[2]
    L = prepare(q, k, v, table, lens, block=block, paged=paged, window=window,
                kv_scales=kv_scales, scale=scale)  # fmt: skip
    # head_dim 256 (Gemma): 64-token tiles overflow the SM's shared memory at fp32 and spill
    # with per-token scales; 32-token tiles fit (benchmarks/compile_sm90.py)
    tile = TILE if L.d_pad <= 128 else TILE // 2
    # fp32 dots run on FMA units, not tensor cores: 8 warps keep them out of local memory
    # (4 warps spill ~1 KB per thread at head_dim 96; see benchmarks/compile_sm90.py)
    warps = 8 if q.dtype == torch.float32 else 4
    if part_tokens % tile:
        raise ValueError(f"part_tokens ({part_tokens}) must be a multiple of {tile}")
    span = max_len if window is None else min(max_len, window)  # tokens one program reads
    num_parts = num_partitions(span, part_tokens)
    dev = q.device
    m = torch.empty((b, hq, num_parts), dtype=torch.float32, device=dev)
    lsum = torch.empty_like(m)
    o = torch.empty((b, hq, num_parts, L.d_pad), dtype=torch.float32, device=dev)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=dev)
    partial = (
        _decode_partial, (b, hk, num_parts),
        (q, k, v, L.table, lens, m, lsum, o, *L.scale_args, L.scale, num_parts,
         window or FULL, q.stride(0), q.stride(1), *L.kv_args),
        dict(G=L.g, G_PAD=max(G_MIN, triton.next_power_of_2(L.g)), D=d, D_PAD=L.d_pad,
             TILE=tile, BLOCK=block, PART_TILES=part_tokens // tile, PAGED=paged,
             PRECISION=L.precision, DOT_FP32=L.dot_fp32, QUANT=L.quant, num_warps=warps),
    )  # fmt: skip
    combine = (
        _combine, (b, hq),
        (m, lsum, o, out, out.stride(0), out.stride(1), num_parts),
        dict(D=d, D_PAD=L.d_pad, P_CHUNK=P_CHUNK),
    )  # fmt: skip
    return out, [partial, combine]


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    *,
    max_len: int,
    paged: bool,
    block: int,
    scale: float | None = None,
    part_tokens: int = PART_TOKENS,
    window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split-K decode. q: ``[B, N_Q, d_h]``; lens: ``[B]`` int32 on q's device (each ≥ 1);
    ``max_len``: a host int ≥ every length (sizes the grid; no device read).

    paged: k, v ``[num_blocks, block, N_KV, d_h]``, table ``[B, max_blocks]`` int32.
    contiguous: k, v ``[S, L, N_KV, d_h]`` (any strides, last dim contiguous), table ``[B]``
    int32 slot ids; ``block`` is then unused. ``window``: a sliding window W (keys
    (len − 1 − W, len − 1]), None for full attention. ``kv_scales`` when k, v hold FP8/INT8:
    fp32 ``[2, N_KV]`` (K's then V's per-head scales), or per token a pair (K's, V's) of fp32
    ``[S, L, N_KV]`` / ``[num_blocks, block, N_KV]`` views (any strides, last dim contiguous).
    Returns ``[B, N_Q, d_h]``, q's dtype.
    """
    out, runs = launches(q, k, v, table, lens, max_len=max_len, paged=paged, block=block,
                         scale=scale, part_tokens=part_tokens, window=window,
                         kv_scales=kv_scales)  # fmt: skip
    if q.shape[0] == 0:
        return out
    for kernel, grid, args, kwargs in runs:
        kernel[grid](*args, **kwargs)
    return out
