"""Attention over VMKVCache's virtual tensors, with unmodified contiguous kernels.

Dispatch (each step feature-tested, never assumed), all of them "class A": they never read a
row at or past a sequence's length.

1. ``flash_attn_with_kvcache(q, K, V, cache_seqlens, cache_batch_idx)``: flash-attn installed,
   CUDA, fp16/bf16, d_h % 8 == 0 (vAttention's exact contract).
2. ``torch.ops.aten._flash_attention_forward`` varlen with ``seqused_k``; ``cu_seq_k`` holds
   each sequence's first row in the flattened ``[S·L_row, N_KV, d_h]`` view:

       flat rows: | slot 0: L_row rows | slot 1: L_row rows | ...
       cu_k[i] = slot_i · L_row  (sorted by slot);  reads rows [cu_k[i], cu_k[i] + len_i)

   VMKVCache pads rows to lcm(page, token row), so L_row is a whole number of tokens for
   every head_dim, layer count and layout.
3. our Triton kernels (stride addressing, int64 offsets) on CUDA: decode, and prefill
   (:mod:`.triton_prefill`); the only fused path for FP8/INT8 K/V, which FlashAttention
   cannot read.
4. SDPA once per sequence on ``K[s, :len]`` views (CPU; always correct). On the CPU under
   ``TRITON_INTERPRET=1`` the Triton kernel is available after it, for tests (``impl=``).

Per-step metadata comes from :func:`.plan.plan` (built once per step, on the device).
"""

from __future__ import annotations

import functools
import math

import torch

from vmcache.kernels import triton_decode, triton_prefill
from vmcache.kernels.common import attend_cache_views, layer_window, packed_trees
from vmcache.kernels.plan import plan

IMPLS = ("flash_attn", "aten_fa2", "triton", "sdpa")
PREFILL_IMPLS = ("aten_fa2", "triton", "sdpa")


@functools.cache
def _flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:  # noqa: BLE001 - not installed or built for another torch
        return None
    return flash_attn_with_kvcache


@functools.cache
def _aten_fa2_has_seqused_k() -> bool:
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == "seqused_k" for a in schema.arguments)


def _fa_dtype_ok(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0


def available_impls(q: torch.Tensor, quantized: bool = False) -> list[str]:
    """The contiguous-path implementations usable for ``q`` on this machine, best first.
    ``quantized`` (FP8/INT8 K/V): FlashAttention (flash-attn, aten FA2) reads K/V in q's
    dtype only, so our Triton kernel (dequantizing in registers) serves decode on CUDA."""
    out = []
    if _fa_dtype_ok(q) and _flash_attn() is not None and not quantized:
        out.append("flash_attn")
    if (
        _fa_dtype_ok(q)
        and not quantized
        and q.shape[-1] <= 256
        and _aten_fa2_has_seqused_k()
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    ):
        out.append("aten_fa2")
    if q.is_cuda and triton_decode.triton_usable(q.device):
        out.append("triton")
    out.append("sdpa")
    if not q.is_cuda and triton_decode.triton_usable(q.device):
        out.append("triton")  # interpreted: for tests only, never the default
    return out


def flat_rows(x: torch.Tensor, l_row: int) -> torch.Tensor:
    """``[S, L, H, D]`` (rows of ``l_row`` whole tokens) as ``[S·L_row, H, D]``: token t of
    row s is flat row ``s·l_row + t``. A tensor of one row may carry any row stride (torch
    re-strides a size-1 dimension: ``unflatten`` gives it the dense one), so only a tensor of
    two rows or more is checked."""
    s_stride, t_stride = x.stride(0), x.stride(1)
    if x.shape[0] > 1 and s_stride != l_row * t_stride:
        raise ValueError(f"row stride {s_stride} is not {l_row} token rows of {t_stride}")
    return x.as_strided((x.shape[0] * l_row, x.shape[2], x.shape[3]), (t_stride, x.stride(2), 1))


def _aten_fa2(cache, layer, q, seq_ids, q_lens, scale, plans):
    p = plan(cache, seq_ids, q_lens, varlen=True, layer=layer, plans=plans)
    l_row, w = cache.views.layer_row_tokens(layer), layer_window(cache, layer)
    k = flat_rows(cache.views.k_cache(layer), l_row)
    v = flat_rows(cache.views.v_cache(layer), l_row)
    window = {} if w is None else dict(window_size_left=w - 1, window_size_right=0)
    out = torch.ops.aten._flash_attention_forward(
        q.index_select(0, p.perm), k, v, p.cu_q, p.cu_k, p.max_q, p.max_kv, 0.0, True, False,
        scale=scale, seqused_k=p.used_k, **window,
    )[0]  # fmt: skip
    return out.index_select(0, p.inv)


def decode(cache, layer, q, seq_ids, scale=None, impl=None, plans=None):
    """q: ``[B, N_Q, d_h]`` → ``[B, N_Q, d_h]``; attends over each sequence's whole length.
    ``plans``: the step's plan memo (:func:`~vmcache.kernels.plan.plan`)."""
    quantized = cache.spec.quantized
    impl = impl or available_impls(q, quantized)[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl not in IMPLS:
        raise ValueError(f"unknown contiguous impl {impl!r}; expected one of {IMPLS}")
    if quantized and impl not in ("triton", "sdpa"):
        raise ValueError(f"impl {impl!r} cannot read FP8/INT8 K/V; use 'triton' or 'sdpa'")
    if impl == "aten_fa2":
        return _aten_fa2(cache, layer, q, seq_ids, [1] * len(seq_ids), scale, plans)
    if impl == "sdpa":
        return attend_cache_views(cache, layer, q, seq_ids, [1] * len(seq_ids), scale)
    p = plan(cache, seq_ids, [1] * len(seq_ids), layer=layer, plans=plans)
    w = layer_window(cache, layer)
    if impl == "flash_attn":  # window_size=(W − 1, 0): keys (p − W, p], FA reads no others
        window = (-1, -1) if w is None else (w - 1, 0)
        out = _flash_attn()(q.unsqueeze(1), cache.views.k_cache(layer), cache.views.v_cache(layer),
                            cache_seqlens=p.lens, cache_batch_idx=p.slots, softmax_scale=scale,
                            causal=True, window_size=window)  # fmt: skip
        return out.squeeze(1)
    return triton_decode.decode(
        q, cache.views.k_cache(layer), cache.views.v_cache(layer), p.slots, p.lens,
        max_len=p.max_kv,
        paged=False, block=1, scale=scale, window=w,
        kv_scales=cache.views.kv_scales_for(layer),
    )  # fmt: skip


def prefill(cache, layer, q, seq_ids, q_lens, scale=None, impl=None, masks=None, plans=None):
    """q packed ``[Σ q_lens, N_Q, d_h]``; causal over the cached prefix plus the new tokens.
    Default: aten FA2 where it runs, else our Triton prefill on CUDA (FP8/INT8 K/V too), else
    SDPA per sequence (dequantized copies for FP8/INT8). ``masks`` (token trees, Triton
    only): see :func:`vmcache.kernels.api.attend`."""
    quantized = cache.spec.quantized
    if impl is None:
        usable = available_impls(q, quantized)
        impl = "aten_fa2" if "aten_fa2" in usable else "triton" if q.is_cuda and (
            "triton" in usable) else "sdpa"  # fmt: skip
    if impl not in PREFILL_IMPLS:
        raise ValueError(f"unknown contiguous prefill impl {impl!r}; expected one of "
                         f"{PREFILL_IMPLS}")  # fmt: skip
    if quantized and impl == "aten_fa2":
        raise ValueError(f"impl {impl!r} cannot read FP8/INT8 K/V; use 'triton' or 'sdpa'")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "aten_fa2":
        return _aten_fa2(cache, layer, q, seq_ids, list(q_lens), scale, plans)
    if impl == "sdpa":
        return attend_cache_views(cache, layer, q, seq_ids, q_lens, scale)
    trees, packed = packed_trees(masks)
    p = plan(cache, seq_ids, list(q_lens), layer=layer, trees=trees, plans=plans)
    return triton_prefill.prefill(
        q, cache.views.k_cache(layer), cache.views.v_cache(layer), p.slots, p.lens, p.starts,
        max_q=p.max_q, paged=False, block=1, scale=scale, window=layer_window(cache, layer),
        kv_scales=cache.views.kv_scales_for(layer), tree_masks=packed, mask_starts=p.mask_starts,
    )  # fmt: skip
