"""Attention over VMKVCache's virtual tensors, with unmodified contiguous kernels.

Dispatch (each step feature-tested, never assumed), all of them "class A" in
shared/notes/gpu_paths.md: they never read a row at or past a sequence's length.

1. ``flash_attn_with_kvcache(q, K, V, cache_seqlens, cache_batch_idx)``: flash-attn installed,
   CUDA, fp16/bf16, d_h % 8 == 0 (vAttention's exact contract).
2. ``torch.ops.aten._flash_attention_forward`` varlen with ``seqused_k``; ``cu_seq_k`` holds
   each sequence's first row in the flattened ``[S·L_row, N_KV, d_h]`` view:

       flat rows: | slot 0: L_row rows | slot 1: L_row rows | ...
       cu_k[i] = slot_i · L_row  (sorted by slot);  reads rows [cu_k[i], cu_k[i] + len_i)

3. our Triton kernel (stride addressing, int64 offsets): CUDA, or CPU under the interpreter.
4. SDPA once per sequence on ``K[s, :len]`` views (CPU; always correct).
"""

from __future__ import annotations

import functools
import math

import torch

from . import triton_decode
from .common import attend_cache_views

IMPLS = ("flash_attn", "aten_fa2", "triton", "sdpa")


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


def available_impls(q: torch.Tensor) -> list[str]:
    """The contiguous-path implementations usable for ``q`` on this machine, best first."""
    out = []
    if _fa_dtype_ok(q) and _flash_attn() is not None:
        out.append("flash_attn")
    if (
        _fa_dtype_ok(q)
        and q.shape[-1] <= 256
        and _aten_fa2_has_seqused_k()
        and torch.backends.cuda.is_flash_attention_available()
        and torch.cuda.get_device_capability(q.device)[0] >= 8
    ):
        out.append("aten_fa2")
    if triton_decode.triton_usable(q.device):
        out.append("triton")
    out.append("sdpa")
    return out


def _flat_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``[S, L, H, D]`` (rows padded to pages) as ``[S·L_row, H, D]``; returns (view, L_row)."""
    s_stride, t_stride = x.stride(0), x.stride(1)
    assert s_stride % t_stride == 0, "row stride must be a whole number of token rows"
    l_row = s_stride // t_stride
    flat = x.as_strided((x.shape[0] * l_row, x.shape[2], x.shape[3]),
                        (t_stride, x.stride(2), 1))  # fmt: skip
    return flat, l_row


def _aten_fa2(cache, layer, q, seq_ids, q_lens, scale):
    order = sorted(range(len(seq_ids)), key=lambda i: seq_ids[i])  # cu_k must be monotonic
    slots = [seq_ids[i] for i in order]
    qls = [q_lens[i] for i in order]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q_sorted = torch.cat([q[starts[i] : starts[i] + q_lens[i]] for i in order])
    k, l_row = _flat_rows(cache.k_cache(layer))
    v, _ = _flat_rows(cache.v_cache(layer))
    dev = q.device
    cu_q = torch.tensor([0] + list(torch.tensor(qls).cumsum(0)), dtype=torch.int32, device=dev)
    cu_k = torch.tensor([s * l_row for s in slots] + [(slots[-1] + 1) * l_row],
                        dtype=torch.int32, device=dev)  # fmt: skip
    lens = [cache.seq_len(s) for s in slots]
    out = torch.ops.aten._flash_attention_forward(
        q_sorted, k, v, cu_q, cu_k, max(qls), max(lens), 0.0, True, False,
        scale=scale, seqused_k=torch.tensor(lens, dtype=torch.int32, device=dev),
    )[0]  # fmt: skip
    result = torch.empty_like(q)
    pos = 0
    for i in order:
        result[starts[i] : starts[i] + q_lens[i]] = out[pos : pos + q_lens[i]]
        pos += q_lens[i]
    return result


def decode(cache, layer, q, seq_ids, scale=None, impl=None):
    """q: ``[B, N_Q, d_h]`` → ``[B, N_Q, d_h]``; attends over each sequence's whole length."""
    impl = impl or available_impls(q)[0]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "flash_attn":
        slots = torch.tensor(seq_ids, dtype=torch.int32, device=q.device)
        lens = cache.seq_lens[slots.long()]
        out = _flash_attn()(q.unsqueeze(1), cache.k_cache(layer), cache.v_cache(layer),
                            cache_seqlens=lens, cache_batch_idx=slots, softmax_scale=scale,
                            causal=True)  # fmt: skip
        return out.squeeze(1)
    if impl == "aten_fa2":
        return _aten_fa2(cache, layer, q, seq_ids, [1] * len(seq_ids), scale)
    if impl == "triton":
        slots = torch.tensor(seq_ids, dtype=torch.int32, device=q.device)
        return triton_decode.decode(
            q, cache.k_cache(layer), cache.v_cache(layer), slots, cache.seq_lens[slots.long()],
            paged=False, block=64, scale=scale,
        )  # fmt: skip
    if impl == "sdpa":
        return attend_cache_views(cache, layer, q, seq_ids, [1] * len(seq_ids), scale)
    raise ValueError(f"unknown contiguous impl {impl!r}; expected one of {IMPLS}")


def prefill(cache, layer, q, seq_ids, q_lens, scale=None, impl=None):
    """q packed ``[Σ q_lens, N_Q, d_h]``; causal over the cached prefix plus the new tokens."""
    if impl is None:
        impl = "aten_fa2" if "aten_fa2" in available_impls(q) else "sdpa"
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if impl == "aten_fa2":
        return _aten_fa2(cache, layer, q, seq_ids, list(q_lens), scale)
    if impl == "sdpa":
        return attend_cache_views(cache, layer, q, seq_ids, q_lens, scale)
    raise ValueError(f"unknown contiguous prefill impl {impl!r}; expected 'aten_fa2' or 'sdpa'")
