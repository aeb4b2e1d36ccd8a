"""Plan, then run: the per-step metadata every layer's attention reads, built once on the
device and reused until the batch or the cache changes (FlashInfer's plan/run split).

A step calls attention once per layer with the same sequences; only the first call builds
(and uploads) the plan, the others find it by key, so no layer uploads or synchronises:

    key    = (seq_ids, q_lens, kv_lens)           every cache: the lengths the kernels bound
           + cache.epoch                          PagedKVCache: block tables move on CoW/grow
    slots  [B] int32      sequence ids (VMKVCache rows, block-table rows)
    lens   [B] int32      kv lengths, batch order
    tables [B, W] int32   PagedKVCache block tables (W = the longest table)
    varlen: sequences sorted by slot (aten FA2 needs a monotonic cu_k):
    perm   [Σq] int64     q_sorted = q[perm];  out = out_sorted[inv]
    cu_q   [B+1] int32    cumulative q lengths, sorted order
    cu_k   [B+1] int32    slot · L_row (each row's first token in the flat layer view)
    used_k [B] int32      kv lengths, sorted order (seqused_k)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepPlan:
    key: tuple
    max_q: int  # host ints: grid sizes and FA2's max_seqlen_q/k, never read from the device
    max_kv: int
    slots: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor | None
    perm: torch.Tensor | None
    inv: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    used_k: torch.Tensor | None


def _upload(values, dtype, device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def plan(cache, seq_ids: list[int], q_lens: list[int], *, varlen: bool = False) -> StepPlan:
    """The step's plan for ``seq_ids`` (validated by the caller) with ``q_lens`` queries each;
    ``varlen`` adds the sorted varlen metadata (aten FA2). Cached on the cache
    (``cache.step_plan``, owned here); counted in ``cache.plans_built``."""
    kv_lens = tuple(cache._lens[s] for s in seq_ids)
    paged = hasattr(cache, "block_tables")
    key = (tuple(seq_ids), tuple(q_lens), kv_lens, cache.epoch if paged else 0)
    old = cache.step_plan
    if old is not None and old.key == key and (old.perm is not None or not varlen):
        return old
    dev = cache.device
    slots = _upload(list(seq_ids), torch.int32, dev)
    lens = _upload(list(kv_lens), torch.int32, dev)
    tables = cache.block_tables(seq_ids) if paged else None
    perm = inv = cu_q = cu_k = used_k = None
    if varlen:
        l_row = cache.row_bytes // cache.token_bytes  # whole tokens: rows are lcm-padded
        order = sorted(range(len(seq_ids)), key=lambda i: seq_ids[i])
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        idx = [t for i in order for t in range(starts[i], starts[i] + q_lens[i])]
        inverse = [0] * len(idx)
        for pos, t in enumerate(idx):
            inverse[t] = pos
        cum = [0]
        for i in order:
            cum.append(cum[-1] + q_lens[i])
        first = [seq_ids[i] * l_row for i in order]
        if (seq_ids[order[-1]] + 1) * l_row >= 2**31:
            raise ValueError("cu_seqlens_k would overflow int32: fewer or shorter rows")
        perm, inv = _upload(idx, torch.int64, dev), _upload(inverse, torch.int64, dev)
        cu_q = _upload(cum, torch.int32, dev)
        cu_k = _upload(first + [(seq_ids[order[-1]] + 1) * l_row], torch.int32, dev)
        used_k = _upload([kv_lens[i] for i in order], torch.int32, dev)
    p = StepPlan(key, max(q_lens), max(kv_lens), slots, lens, tables, perm, inv, cu_q, cu_k,
                 used_k)  # fmt: skip
    cache.step_plan = p
    cache.plans_built += 1
    return p
