"""Attention over PagedKVCache: Triton split-K paged decode and Triton paged prefill on CUDA
(both read the blocks in place); on the CPU, a gather per sequence and SDPA."""

from __future__ import annotations

from vmcache.kernels import triton_decode, triton_prefill
from vmcache.kernels.common import attend_cache_views, layer_window, packed_trees
from vmcache.kernels.plan import plan


def decode(cache, layer: int, q, seq_ids: list[int], scale=None, impl=None, plans=None):
    """q: ``[B, N_Q, d_h]``; returns ``[B, N_Q, d_h]``. impl: None (auto), "triton", "sdpa"
    (gather + SDPA per sequence). ``plans``: the step's plan memo (:func:`plan`)."""
    if impl is None:  # interpreted Triton on the CPU is for tests (impl="triton"), never default
        impl = "triton" if q.is_cuda else "sdpa"
    if impl == "triton":
        p = plan(cache, seq_ids, [1] * len(seq_ids), layer=layer, plans=plans)
        return triton_decode.decode(
            q, cache.views.k_pool(layer), cache.views.v_pool(layer), p.tables, p.lens,
            max_len=p.max_kv, paged=True, block=cache.config.block_size, scale=scale,
            window=layer_window(cache, layer),
            kv_scales=cache.views.kv_scales_for(layer),
        )  # fmt: skip
    if impl == "sdpa":
        return attend_cache_views(cache, layer, q, seq_ids, [1] * len(seq_ids), scale)
    raise ValueError(f"unknown paged decode impl {impl!r}; expected 'triton' or 'sdpa'")


def prefill(cache, layer, q, seq_ids, q_lens, scale=None, impl=None, masks=None, plans=None):
    """q packed ``[Σ q_lens, N_Q, d_h]``. impl: None (auto: "triton" on CUDA), "triton",
    "sdpa" (gather + SDPA per sequence). ``masks`` (token trees, Triton only): see
    :func:`vmcache.kernels.api.attend`."""
    if impl is None:  # interpreted Triton on the CPU is for tests (impl="triton"), never default
        impl = "triton" if q.is_cuda else "sdpa"
    if impl == "triton":
        trees, packed = packed_trees(masks)
        p = plan(cache, seq_ids, list(q_lens), layer=layer, trees=trees, plans=plans)
        return triton_prefill.prefill(
            q, cache.views.k_pool(layer), cache.views.v_pool(layer), p.tables, p.lens, p.starts,
            max_q=p.max_q, paged=True, block=cache.config.block_size, scale=scale,
            window=layer_window(cache, layer), kv_scales=cache.views.kv_scales_for(layer),
            tree_masks=packed, mask_starts=p.mask_starts,
        )  # fmt: skip
    if impl == "sdpa":
        return attend_cache_views(cache, layer, q, seq_ids, q_lens, scale)
    raise ValueError(f"unknown paged prefill impl {impl!r}; expected 'triton' or 'sdpa'")
