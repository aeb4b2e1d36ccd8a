"""Validation and the per-sequence SDPA path shared by both caches' attention."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F


def check_inputs(cache, layer: int, q: torch.Tensor, seq_ids, q_lens=None) -> list[int]:
    """Validate a decode/prefill call; returns ``seq_ids`` as a list of live sequence ids."""
    if isinstance(seq_ids, torch.Tensor):
        seq_ids = seq_ids.tolist()
    seq_ids = list(seq_ids)
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a 3-D tensor [tokens, N_Q, d_h], got {getattr(q, 'shape', q)}")
    spec = cache.spec
    if q.shape[2] != spec.head_dim or q.shape[1] % spec.num_kv_heads:
        raise ValueError(
            f"q must be [tokens, N_Q, {spec.head_dim}] with N_Q a multiple of "
            f"{spec.num_kv_heads}, got {list(q.shape)}"
        )
    if q.device.type != cache.config.device.type:
        raise ValueError(f"q must be on {cache.config.device}, got {q.device}")
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"seq_ids must be distinct, got {seq_ids}")
    lens = [cache.seq_len(s) for s in seq_ids]
    want = len(seq_ids) if q_lens is None else sum(q_lens)
    if q.shape[0] != want:
        raise ValueError(f"q holds {q.shape[0]} tokens, expected {want}")
    if q_lens is not None:
        if len(q_lens) != len(seq_ids):
            raise ValueError("q_lens and seq_ids must have the same length")
        for s, n, ql in zip(seq_ids, lens, q_lens):
            if not 1 <= ql <= n:
                raise ValueError(f"sequence {s}: q_len {ql} must be in [1, seq_len={n}]")
    elif any(n < 1 for n in lens):
        raise ValueError("decode needs every sequence to hold at least one token")
    cache.views.check_layer(layer)
    return seq_ids


def layer_window(cache, layer: int) -> int | None:
    """The sliding window of ``layer`` (None: full attention)."""
    windows = cache.spec.layer_windows
    return None if windows is None else windows[layer]


def causal_lower_right(q_len: int, kv_len: int, device, window: int | None = None):
    """``[q_len, kv_len]`` bool: query i (the last q_len keys are the queries' own) sees keys
    ``[0, p]``, p = kv_len − q_len + i; with a window W only ``(p − W, p]``."""
    i = torch.arange(q_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    p = i + (kv_len - q_len)
    mask = j <= p
    return mask if window is None else mask & (j > p - window)


def tree_mask(ancestors: torch.Tensor, kv_len: int) -> torch.Tensor:
    """``[q_len, kv_len]`` bool for a token tree: its ``q_len`` tokens are the last keys, every
    one sees the whole history before them and, among the tree's tokens, itself and its
    ancestors only (``ancestors``: bool ``[q_len, q_len]``, row i true at i's ancestors).

        keys:   | history (kv_len − q_len)  | t  a1 a2 b1      (tree: t → a1 → a2, t → b1)
        b1:     | 1 1 1 ... 1               | 1  0  0  1
        a2:     | 1 1 1 ... 1               | 1  1  1  0
    """
    q_len = ancestors.shape[0]
    mask = torch.ones((q_len, kv_len), dtype=torch.bool, device=ancestors.device)
    mask[:, kv_len - q_len :] = ancestors
    return mask


MAX_TREE_TOKENS = 32  # a tree's ancestor rows are 32-bit words in the Triton prefill


class TreeMasks(list):
    """A step's token-tree masks (a list: None or bool ``[q_len, q_len]`` per sequence) that
    packs its ancestor words once (:func:`packed_trees`): every layer of the step passes the
    same object, so the Triton prefill of each layer reuses them. The masks must not change
    while it is in use."""

    def __init__(self, masks) -> None:
        super().__init__(masks)
        self._packed = None  # (flags, words), computed at the first layer (owned here)

    def packed(self):
        if self._packed is None:
            self._packed = _pack_trees(self)
        return self._packed


def packed_trees(masks):
    """(a flag per sequence, int32 ``[Σ q_len of the trees]``: each tree query's ancestors as
    a bit field, bit j set where it sees the tree's token j, trees in batch order) for the
    Triton prefill, from ``masks`` (None or bool ``[q_len, q_len]`` each, q_len <=
    :data:`MAX_TREE_TOKENS`; on q's device: computed there); (None, None) without trees.
    A :class:`TreeMasks` computes them once for all its layers."""
    if isinstance(masks, TreeMasks):
        return masks.packed()
    return _pack_trees(masks)


def _pack_trees(masks):
    if masks is None or all(m is None for m in masks):
        return None, None
    flags = tuple(m is not None for m in masks)
    rows = []
    for m in masks:
        if m is not None:
            n = m.shape[1]
            if n > MAX_TREE_TOKENS:
                raise ValueError(f"a tree of {n} tokens has no Triton path (at most "
                                 f"{MAX_TREE_TOKENS}); use impl='sdpa' / 'torch'")  # fmt: skip
            bits = torch.arange(n, device=m.device, dtype=torch.int64)
            rows.append((m.to(torch.int64) << bits).sum(1))
    # bit 31 set is a negative int32 (two's complement): the same 32 bits the kernel tests
    return flags, torch.cat(rows).to(torch.int32)


def sdpa_per_sequence(
    q: torch.Tensor,
    q_lens: Sequence[int],
    kvs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    masks: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """One SDPA call per sequence on its own ``[len, N_KV, d_h]`` views (no padding, so no
    byte past a sequence's length is read; views that start at a window's first mapped
    token read nothing before it). q: packed ``[Σ q_lens, N_Q, d_h]``; ``window``: sliding
    window W of the layer (None: full); ``masks[i]``: None (causal) or a token tree's bool
    ``[q_len, q_len]`` (see :func:`tree_mask`)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out = torch.empty_like(q)
    start = 0
    for i, (ql, (k, v)) in enumerate(zip(q_lens, kvs)):
        qi = q[start : start + ql].transpose(0, 1).unsqueeze(0)  # [1, N_Q, ql, d]
        ki, vi = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        n = k.shape[0]
        tree = None if masks is None else masks[i]
        full = ql == 1 and (window is None or n <= window)
        if tree is not None:
            mask = tree_mask(tree, n)
        else:
            mask = None if full else causal_lower_right(ql, n, q.device, window)
        if softcap is None:
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                               enable_gqa=True)  # fmt: skip
        else:
            o = _softcapped(qi, ki, vi, mask, scale, softcap)
        out[start : start + ql] = o[0].transpose(0, 1)
        start += ql
    return out


def _softcapped(q, k, v, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with soft-capped logits, as transformers' eager Gemma 2 computes it:
    q ``[1, N_Q, q, d]``, k, v ``[1, N_KV, n, d]``, mask ``[q, n]`` bool (True = keep) or
    None; softmax in fp32."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    return torch.matmul(w.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def attend_cache_views(cache, layer: int, q: torch.Tensor, seq_ids, q_lens, scale,
                       softcap: float | None = None, masks=None):  # fmt: skip
    """:func:`sdpa_per_sequence` over each sequence's ``cache.kv`` (zero-copy views on
    VMKVCache, gathers on PagedKVCache): the fallback path of both caches, and the path of
    token trees (``masks``)."""
    kvs = [cache.kv(layer, s) for s in seq_ids]
    return sdpa_per_sequence(q, q_lens, kvs, scale, layer_window(cache, layer), softcap, masks)
