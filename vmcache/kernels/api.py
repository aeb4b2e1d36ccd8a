"""decode / prefill entry points: validate, then dispatch on the cache type."""

from __future__ import annotations

import torch

from vmcache.kernels import batched, contiguous, paged
from vmcache.kernels.common import (
    MAX_TREE_TOKENS,
    attend_cache_views,
    check_inputs,
    layer_window,
)


def _module(cache):
    from vmcache.paged_fallback import PagedKVCache
    from vmcache.sequences.cache import VMKVCache

    if isinstance(cache, VMKVCache):
        return contiguous
    if isinstance(cache, PagedKVCache):
        return paged
    raise TypeError(f"cache must be a VMKVCache or PagedKVCache, got {type(cache).__name__}")


def decode(cache, layer: int, q: torch.Tensor, seq_ids, scale=None, impl=None,
           plans: dict | None = None) -> torch.Tensor:  # fmt: skip
    """One token a sequence. ``plans``: the step's plan memo (FlashInfer's wrapper): a dict the
    caller holds for one step and passes to every layer's call, so only the first layer
    builds and uploads the step's metadata (:func:`~vmcache.kernels.plan.plan`); None uses
    the one ``cache.views.plans`` keeps."""
    mod = _module(cache)
    seq_ids = check_inputs(cache, layer, q, seq_ids)
    return mod.decode(cache, layer, q, seq_ids, scale=scale, impl=impl, plans=plans)


def prefill(cache, layer: int, q, seq_ids, q_lens, scale=None, impl=None,
            plans: dict | None = None) -> torch.Tensor:  # fmt: skip
    """Packed new tokens over each sequence's cached prefix; ``plans`` as in :func:`decode`."""
    mod = _module(cache)
    q_lens = [int(x) for x in q_lens]
    seq_ids = check_inputs(cache, layer, q, seq_ids, q_lens)
    return mod.prefill(cache, layer, q, seq_ids, q_lens, scale=scale, impl=impl, plans=plans)


def attend(cache, layer: int, q, seq_ids, q_lens, scale=None, impl=None,
           softcap: float | None = None, masks=None, batch=None,
           plans: dict | None = None) -> torch.Tensor:  # fmt: skip
    """Packed variable-length attention (q ``[Σ q_lens, N_Q, d_h]``): :func:`decode` when
    every sequence brings one token, else :func:`prefill`. ``softcap`` (logit soft-capping,
    Gemma 2) has no fused kernel here: it runs the per-sequence torch path on any device.

    ``batch`` (the step's :class:`~vmcache.sequences.batch.StepBatch` for exactly these
    ``seq_ids`` and ``q_lens``, built once a step): the inputs were checked when it was
    built, and where the default would be the per-sequence SDPA path (the CPU; ``impl``
    None or ``"batched"``), the whole step runs as one gather and one SDPA call per kind of
    sequence (:func:`~vmcache.kernels.batched.attend_batch`), softcap included.

    ``plans``: the step's plan memo, as in :func:`decode`.

    ``masks[i]`` (token trees): None for a causal sequence, or bool ``[q_lens[i], q_lens[i]]``,
    row j true at the tree tokens query j sees (itself and its ancestors; see
    :func:`~vmcache.kernels.common.tree_mask`). On CUDA (or with ``impl="triton"``) the
    whole step is one Triton prefill that reads each tree's mask (causal rows for the
    others); elsewhere, or with ``softcap``, tree sequences run SDPA with that explicit mask
    on the cache's own views and the others take the usual kernels, packed apart:

        q:      | a (causal) | T (tree) | b (causal) |
        triton: | a            T + its mask     b    |    one call, every sequence
        else:   | a          |            b          |    prefill/decode, one call
                             | T + its mask |             SDPA, one call per tree
    """
    trees = masks is not None and any(m is not None for m in masks)
    if batch is not None and not trees and (impl == "batched" or (impl is None and not q.is_cuda)):
        if tuple(seq_ids) != batch.seq_ids or tuple(q_lens) != batch.q_lens:
            raise ValueError("batch was built for other sequences or query lengths")
        if q.dim() != 3 or q.shape[0] != batch.num_tokens or q.shape[2] != cache.spec.head_dim:
            raise ValueError(f"q must be [{batch.num_tokens}, N_Q, {cache.spec.head_dim}], "
                             f"got {list(q.shape)}")  # fmt: skip
        return batched.attend_batch(cache, layer, q, batch, scale, softcap)
    if impl == "batched":
        raise ValueError("impl 'batched' needs the step's batch (cache.batch(...))")
    if trees:
        return _attend_trees(cache, layer, q, seq_ids, q_lens, scale, impl, softcap, masks,
                             plans)  # fmt: skip
    if softcap is not None and impl not in (None, "sdpa"):
        raise ValueError(f"impl {impl!r} has no logit soft-capping; use None or 'sdpa'")
    _module(cache)
    q_lens = [int(x) for x in q_lens]
    seq_ids = check_inputs(cache, layer, q, seq_ids, q_lens)
    return _run(cache, layer, q, seq_ids, q_lens, scale, impl, softcap, plans)


def _run(cache, layer, q, seq_ids, q_lens, scale, impl, softcap, plans=None):
    """:func:`attend` on inputs already checked: the per-sequence torch path with
    ``softcap``, else decode when every sequence brings one token, else prefill."""
    if softcap is not None:
        return attend_cache_views(cache, layer, q, seq_ids, q_lens, scale, softcap)
    mod = _module(cache)
    if all(n == 1 for n in q_lens):
        return mod.decode(cache, layer, q, seq_ids, scale=scale, impl=impl, plans=plans)
    return mod.prefill(cache, layer, q, seq_ids, q_lens, scale=scale, impl=impl, plans=plans)


def _attend_trees(cache, layer, q, seq_ids, q_lens, scale, impl, softcap, masks, plans=None):
    q_lens = [int(x) for x in q_lens]
    seq_ids = check_inputs(cache, layer, q, seq_ids, q_lens)
    if len(masks) != len(seq_ids):
        raise ValueError("masks needs one entry (None or a tree's mask) per sequence")
    for m, n in zip(masks, q_lens):
        if m is not None and (m.dtype != torch.bool or tuple(m.shape) != (n, n)):
            raise ValueError(f"a tree mask must be bool [{n}, {n}], got {m.dtype} "
                             f"{list(m.shape)}")  # fmt: skip
    if layer_window(cache, layer) is not None:
        raise ValueError("token trees are not supported on sliding-window layers")
    small = all(m is None or m.shape[0] <= MAX_TREE_TOKENS for m in masks)
    if softcap is None and (impl == "triton" or (impl is None and q.is_cuda and small)):
        return _module(cache).prefill(cache, layer, q, seq_ids, q_lens, scale=scale,
                                      impl="triton", masks=masks, plans=plans)  # fmt: skip
    starts = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    rows = [torch.arange(starts[i], starts[i + 1]) for i in range(len(q_lens))]
    tree = [i for i, m in enumerate(masks) if m is not None]
    rest = [i for i, m in enumerate(masks) if m is None]
    out = torch.empty_like(q)
    pick = torch.cat([rows[i] for i in tree]).to(q.device)
    out[pick] = attend_cache_views(cache, layer, q[pick], [seq_ids[i] for i in tree],
                                   [q_lens[i] for i in tree], scale, softcap,
                                   [masks[i] for i in tree])  # fmt: skip
    if rest:
        pick = torch.cat([rows[i] for i in rest]).to(q.device)
        out[pick] = _run(cache, layer, q[pick], [seq_ids[i] for i in rest],
                         [q_lens[i] for i in rest], scale, impl, softcap, plans)  # fmt: skip
    return out
