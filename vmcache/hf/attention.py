"""``attn_implementation="vmcache"``: transformers' attention function that reads the K/V
where :class:`~vmcache.hf.VMCache` / :class:`~vmcache.hf.PagedCache` keep them
(:mod:`vmcache.kernels`), with SDPA for padded steps and for tensors of other caches."""

from __future__ import annotations

import sys
from typing import Protocol, runtime_checkable

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from vmcache.sequences.spec import KVSpec

ATTN_NAME = "vmcache"
# the engine's packed step: the same attention function, and a mask function that builds
# nothing (a packed row of several sequences has no one mask: the cache reads each itself)
STEP_ATTN_NAME = "vmcache_packed_step"


@runtime_checkable
class ReadsItself(Protocol):
    """What tags its K/V for :func:`vmcache_attention` (``key._vmcache = (owner, layer)``):
    the drop-in caches (:class:`~vmcache.hf.VMCache`, ``PagedCache``) and the engine's packed
    step (:class:`vmcache.engine.runner.StepCache`)."""

    spec: KVSpec  # the stored K/V's shape and dtypes; queries are cast to ``spec.dtype``

    def attend(self, layer: int, query: torch.Tensor, scale: float | None,
               softcap: float | None = None) -> torch.Tensor:  # fmt: skip
        """query ``[b, N_Q, q, d_h]`` → ``[b, q, N_Q, d_h]``, read from the stored K/V."""
        ...

    def real_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[b, N_KV, n, d_h]`` as real tensors (dequantized, in the model's dtype):
        what SDPA reads on a masked step where ``update`` returned zero-stride stand-ins."""
        ...


def stand_ins(spec: KVSpec, device, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-stride ``[rows, N_KV, n, d_h]`` K and V that cost nothing: what ``update``
    returns when :func:`vmcache_attention` will read the cache itself."""
    one = torch.zeros((), dtype=spec.dtype, device=device)
    shape = (rows, spec.num_kv_heads, n, spec.head_dim)
    return one.expand(shape), one.expand(shape)


def vmcache_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      **kwargs):  # fmt: skip
    """transformers attention function: query ``[b, N_Q, q, d_h]`` → ``[b, q, N_Q, d_h]``.
    K/V tagged by a :class:`ReadsItself` owner (``key._vmcache = (owner, layer)``) are read
    where they live by ``owner.attend``; anything else (other caches, padded steps, over
    ``owner.real_kv`` where ``update`` returned stand-ins) goes to SDPA."""
    ref = getattr(key, "_vmcache", None)
    softcap = kwargs.get("softcap")
    if ref is not None and attention_mask is None:
        owner, layer = ref
        out = owner.attend(layer, query.to(owner.spec.dtype), scaling, softcap)
        return out.to(query.dtype), None
    if ref is not None and key.stride(-1) == 0:
        key, value = ref[0].real_kv(ref[1])  # a masked step needs real tensors
    if softcap is not None:  # SDPA has no soft-capping: the model's own eager function does
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{type(module).__name__} soft-caps its logits and its module "
                             "has no eager_attention_forward to fall back on")  # fmt: skip
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # sdpa_mask's
            attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min
            )  # eager adds its mask
        return eager(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, **kwargs)  # fmt: skip
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)  # fmt: skip


def no_mask(*args, **kwargs) -> None:
    """The mask function of :data:`STEP_ATTN_NAME`: no mask (the step's attention is causal
    per sequence, read from the cache)."""
    return None


def register() -> None:
    """Make ``attn_implementation="vmcache"`` (and the engine's packed step,
    :data:`STEP_ATTN_NAME`) available (idempotent; done on import)."""
    AttentionInterface.register(ATTN_NAME, vmcache_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    AttentionInterface.register(STEP_ATTN_NAME, vmcache_attention)
    AttentionMaskInterface.register(STEP_ATTN_NAME, no_mask)
