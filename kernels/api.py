"""decode / prefill entry points: validate, then dispatch on the cache type."""

from __future__ import annotations

import torch
from vmcache.kernels import contiguous, paged
from vmcache.kernels.common import attend_cache_views, check_inputs


def _module(cache):
    from vmcache.paged_fallback import PagedKVCache

    from vmcache.sequences.cache import VMKVCache

    if isinstance(cache, VMKVCache):
        return contiguous
    if isinstance(cache, PagedKVCache):
        return paged
    raise TypeError(f"cache must be a VMKVCache or PagedKVCache, got {type(cache).__name__}")


def decode(cache, layer: int, q: torch.Tensor, seq_ids, scale=None, impl=None) -> torch.Tensor:
    mod = _module(cache)
    seq_ids = check_inputs(cache, layer, q, seq_ids)
    return mod.decode(cache, layer, q, seq_ids, scale=scale, impl=impl)


def prefill(cache, layer: int, q, seq_ids, q_lens, scale=None, impl=None) -> torch.Tensor:
    mod = _module(cache)
    q_lens = [int(x) for x in q_lens]
    seq_ids = check_inputs(cache, layer, q, seq_ids, q_lens)
    return mod.prefill(cache, layer, q, seq_ids, q_lens, scale=scale, impl=impl)


def attend(cache, layer: int, q, seq_ids, q_lens, scale=None, impl=None,
           softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """Packed variable-length attention (q ``[Σ q_lens, N_Q, d_h]``): :func:`decode` when
    every sequence brings one token, else :func:`prefill`. ``softcap`` (logit soft-capping,
    Gemma 2) has no fused kernel here: it runs the per-sequence torch path on any device."""
    if softcap is not None:
        if impl not in (None, "sdpa", "torch"):
            raise ValueError(f"impl {impl!r} has no logit soft-capping; use None or 'torch'")
        _module(cache)
        q_lens = [int(x) for x in q_lens]
        seq_ids = check_inputs(cache, layer, q, seq_ids, q_lens)
        return attend_cache_views(cache, layer, q, seq_ids, q_lens, scale, softcap)
    if all(int(n) == 1 for n in q_lens):
        return decode(cache, layer, q, seq_ids, scale=scale, impl=impl)
    return prefill(cache, layer, q, seq_ids, q_lens, scale=scale, impl=impl)
