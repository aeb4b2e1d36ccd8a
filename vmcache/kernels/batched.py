"""Attention of a whole step in one SDPA call per kind of sequence: the CPU path of both
caches when the caller hands a :class:`~vmcache.sequences.batch.StepBatch`.

The batch hands every sequence's history (``batch.kv``: ``[B, span, N_KV, d_h]``, a view
of VMKVCache's rows where they lie in consecutive slots, else gathered once; rows past a
sequence's length hold its last token or whatever its mapped pages hold); the queries are
padded to the longest of their group and a boolean mask keeps each query to its own causal keys:

    group:   decodes (q_len 1, one call), then prefills (one padded call, or one call each
             when padding would more than double their queries)
    query i of sequence b sits at position p = kv_len_b − q_len_b + i; key j at lo_b + j
    (lo_b: the window's first mapped token):

        keep(i, j) = j < kv_len_b − lo_b  and  lo_b + j <= p  [and lo_b + j > p − W]
        padded query rows (i >= q_len_b) keep key 0 only; their output is dropped

A step of float32 decodes on the CPU (no window, no soft-capping) skips all of this:
:class:`~vmcache.kernels.cpu_decode_plan.DecodeRows` (checked once a step) reads every history
where it lies.

The masks and row indices are built once per step and window (kept in ``batch.memo``),
then every layer of that group reuses them: per layer, two gathers, one or two SDPA calls
and one scatter of the outputs, whatever the number of sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vmcache.kernels.common import _softcapped, layer_window
from vmcache.kernels.cpu_decode import serves
from vmcache.kernels.cpu_decode_plan import DecodeRows


@dataclass(frozen=True)
class _Group:
    rows: torch.Tensor | None  # int64 [G·max_q]: packed q row of each padded query (None: all)
    sel: torch.Tensor | None  # int64 [G]: batch index of each sequence (None: the whole batch)
    keep: torch.Tensor | None  # int64 [Σ q]: padded rows holding real queries (None: all)
    out: torch.Tensor | None  # int64 [Σ q]: their packed rows (None: all, in order)
    mask: torch.Tensor | None  # bool [G, 1, max_q, span] (None: every key of every query)
    size: int
    max_q: int


def plan_groups(q_lens_: list[int], kv_lens_: list[int], lo: torch.Tensor, span: int, window,
                device) -> list[_Group]:  # fmt: skip
    """The step's groups (decodes; prefills padded together or one each) with their row
    indices and masks, from the sequences' query and K/V lengths (host ints, batch order),
    window starts ``lo`` (int64 ``[B]``) and the longest history ``span``."""
    n_seq = len(q_lens_)
    q_lens, kv_lens = torch.tensor(q_lens_), torch.tensor(kv_lens_)
    first = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)[:-1]])
    dec = [i for i, q in enumerate(q_lens_) if q == 1]
    pre = [i for i, q in enumerate(q_lens_) if q > 1]
    parts = [dec] if dec else []
    if pre:
        padded = len(pre) * max(q_lens_[i] for i in pre)
        real = sum(q_lens_[i] for i in pre)
        parts += [pre] if padded <= 2 * real else [[i] for i in pre]
    groups = []
    for part in parts:
        sel = torch.tensor(part)
        qs, kv, lo_g, base = q_lens[sel], kv_lens[sel], lo[sel], first[sel]
        mq = int(qs.max())
        i = torch.arange(mq)[None, :, None]  # [1, q, 1]
        j = torch.arange(span)[None, None, :]  # [1, 1, span]
        p = (kv - qs)[:, None, None] + i  # absolute position of query i
        key = lo_g[:, None, None] + j  # absolute position of key j
        mask = (j < (kv - lo_g)[:, None, None]) & (key <= p)
        if window is not None:
            mask &= key > p - window
        real_q = i < qs[:, None, None]  # [G, q, 1]
        mask = torch.where(real_q, mask, j == 0)
        whole = len(part) == n_seq
        full = bool(mask.all())
        rows = (base[:, None] + torch.arange(mq)[None].clamp(max=qs[:, None] - 1)).view(-1)
        flat_real = real_q[:, :, 0].reshape(-1)
        keep = torch.nonzero(flat_real)[:, 0]
        out = rows[keep]
        identity = whole and mq == 1  # decodes only, in batch order
        groups.append(_Group(
            rows=None if identity else rows.to(device),
            sel=None if whole else sel.to(device),
            keep=None if identity else keep.to(device),
            out=None if whole else out.to(device),
            mask=None if full else mask[:, None].to(device),
            size=len(part), max_q=mq,
        ))  # fmt: skip
    return groups


def attend_batch(cache, layer: int, q: torch.Tensor, batch, scale: float | None = None,
                 softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """q packed ``[batch.num_tokens, N_Q, d_h]`` (batch order) → the same shape: causal
    attention of every sequence of ``batch`` over its history in ``cache``, ``layer``'s
    window applied; ``softcap``: Gemma 2's soft-capped logits (eager math, fp32 softmax)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    window = layer_window(cache, layer)
    if (batch.max_q == 1 and window is None and softcap is None and not cache.spec.quantized
            and serves(q, cache.spec.dtype)
            and (stored := batch.stored(layer)) is not None):  # fmt: skip
        # decodes only: every history read where it lies, nothing gathered; the kernel's
        # checks and scratch planned once a step for the layers that share a read index
        store, layout = stored
        key = ("decode", batch.group(layer), layout[0])
        plan = batch.memo.get(key)
        if plan is None:
            plan = batch.memo[key] = DecodeRows(batch.read_index(layer)[0],
                                                torch.tensor(batch.kv_lens), layout[0],
                                                q.shape[1], q.shape[2])  # fmt: skip
        return plan(q, store, layout, scale)
    k, v = batch.kv(layer)  # [B, span, N_KV, d_h]
    _, lo, span = batch.read_index(layer)
    key = ("attend", batch.group(layer), window)
    groups = batch.memo.get(key)
    if groups is None:
        groups = batch.memo[key] = plan_groups(list(batch.q_lens), list(batch.kv_lens), lo,
                                               span, window, q.device)  # fmt: skip
    return attend_groups(q, k, v, groups, scale, softcap)


def attend_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: list[_Group],
                  scale: float, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """q packed ``[Σ q, N_Q, d_h]``, every sequence's history K and V ``[B, span, N_KV,
    d_h]`` → ``[Σ q, N_Q, d_h]``: one SDPA call per group of :func:`plan_groups`."""
    heads, dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q) if len(groups) > 1 else None  # one group: the whole batch
    for g in groups:
        kg = k if g.sel is None else k.index_select(0, g.sel)
        vg = v if g.sel is None else v.index_select(0, g.sel)
        qg = q if g.rows is None else q.index_select(0, g.rows)
        qg = qg.view(g.size, g.max_q, heads, dim).transpose(1, 2)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        if softcap is None:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale,
                                               enable_gqa=True)  # fmt: skip
        else:
            o = _softcapped(qg, kg, vg, g.mask, scale, softcap)
        o = o.transpose(1, 2).reshape(g.size * g.max_q, heads, dim)
        if g.keep is not None:
            o = o.index_select(0, g.keep)
        if g.out is None:  # the whole batch, in order
            return o
        out.index_copy_(0, g.out, o)
    return out
