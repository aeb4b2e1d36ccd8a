"""Attention over PagedKVCache: Triton split-K paged decode; prefill gathers per sequence."""

from __future__ import annotations

import torch

from . import triton_decode
from .common import attend_cache_views


def decode(cache, layer: int, q: torch.Tensor, seq_ids: list[int], scale=None, impl=None):
    """q: ``[B, N_Q, d_h]``; returns ``[B, N_Q, d_h]``. impl: None (auto), "triton", "torch"."""
    if impl is None:
        impl = "triton" if triton_decode.triton_usable(q.device) else "torch"
    if impl == "triton":
        lens = cache.seq_lens[torch.tensor(seq_ids, device=cache.device)]
        return triton_decode.decode(
            q, cache.k_pool(layer), cache.v_pool(layer), cache.block_tables(seq_ids), lens,
            paged=True, block=cache.block_size, scale=scale,
        )  # fmt: skip
    if impl == "torch":
        return attend_cache_views(cache, layer, q, seq_ids, [1] * len(seq_ids), scale)
    raise ValueError(f"unknown paged decode impl {impl!r}; expected 'triton' or 'torch'")


def prefill(cache, layer, q, seq_ids, q_lens, scale=None, impl=None):
    if impl not in (None, "torch"):
        raise ValueError(f"unknown paged prefill impl {impl!r}; expected 'torch'")
    return attend_cache_views(cache, layer, q, seq_ids, q_lens, scale)
