"""Plan, then run: the per-step metadata every layer's attention reads, built once on the
device and reused until the batch or the cache changes (FlashInfer's plan/run split).

A step calls attention once per layer with the same sequences; only the first call builds
the plan (one int32 buffer, one host-to-device copy), the others find it by key, so no
layer uploads or synchronises:

    key    = (seq_ids, q_lens, kv_lens)           every cache: the lengths the kernels bound
           + cache.views.epoch                    PagedKVCache: block tables move on CoW/grow
    slots  [B] int32      sequence ids (VMKVCache rows, block-table rows)
    lens   [B] int32      kv lengths, batch order
    starts [B+1] int32    cumulative q lengths, batch order (the Triton prefill's rows of q)
    tables [B, W] int32   PagedKVCache block tables (W = the longest table)
    varlen: sequences sorted by slot (aten FA2 needs a monotonic cu_k):
    perm   [Σq] int32     q_sorted = q[perm];  out = out_sorted[inv]
    cu_q   [B+1] int32    cumulative q lengths, sorted order
    cu_k   [B+1] int32    slot · L_row (each row's first token in the flat layer view)
    used_k [B] int32      kv lengths, sorted order (seqused_k)
    trees: token-tree steps (``trees`` flags per sequence):
    mask_starts [B] int32 each tree's first row in the step's packed ancestor rows (one
                          32-bit word a query, trees in batch order); −1 for a causal one
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
    starts: torch.Tensor
    tables: torch.Tensor | None
    perm: torch.Tensor | None
    inv: torch.Tensor | None
    cu_q: torch.Tensor | None
    cu_k: torch.Tensor | None
    used_k: torch.Tensor | None
    mask_starts: torch.Tensor | None = None


def plan(cache, seq_ids: list[int], q_lens: list[int], *, varlen: bool = False,
         layer: int = 0, trees: tuple[bool, ...] | None = None,
         plans: dict | None = None) -> StepPlan:  # fmt: skip
    """The step's plan for ``seq_ids`` (validated by the caller) with ``q_lens`` queries each,
    for the layers that share ``layer``'s block table (PagedKVCache) or row size (VMKVCache);
    ``varlen`` adds the sorted varlen metadata (aten FA2), ``trees`` (a flag per sequence)
    the token trees' mask offsets (the Triton prefill's tree masks). Every field is a view of
    one int32 buffer, uploaded in one copy. Reads the cache's public views only (lengths,
    epoch, block rows, the layer's table or row size, the device).

    ``plans``: the memo the caller holds for the step (FlashInfer's wrapper: a dict by table /
    row size, entries owned here), so the step's later layers find the plan and upload
    nothing; default: the one ``cache.views.plans`` keeps for callers that hold none. Every
    plan built is counted in ``cache.views.plans_built``."""
    cv = cache.views
    kv_lens = cv.lengths(seq_ids)
    paged = hasattr(cv, "block_tables")
    variant = cv.table_of_layer(layer) if paged else cv.layer_row_tokens(layer)
    key = (tuple(seq_ids), tuple(q_lens), tuple(kv_lens), cv.epoch if paged else 0,
           tuple(trees) if trees else ())  # fmt: skip
    memo = cv.plans if plans is None else plans
    old = memo.get(variant)
    if old is not None and old.key == key and (old.perm is not None or not varlen):
        return old
    if old is None or old.key != key:  # another step: drop its plans
        for k in [k for k, p in memo.items() if p.key != key]:
            del memo[k]
    b = len(seq_ids)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    parts: dict[str, list[int]] = {"slots": list(seq_ids), "lens": kv_lens, "starts": starts}
    if trees:
        at, parts["mask_starts"] = 0, []
        for tree, n in zip(trees, q_lens):
            parts["mask_starts"].append(at if tree else -1)
            at += n if tree else 0
    width = 0
    if paged:
        t = variant
        tabs = [[max(p, 0) for p in cv.block_row(s, t)] for s in seq_ids]  # RELEASED → 0
        width = max([len(t) for t in tabs] + [1])
        parts["tables"] = [p for t in tabs for p in t + [0] * (width - len(t))]
    if varlen:
        l_row = variant
        order = sorted(range(b), key=lambda i: seq_ids[i])
        perm = [t for i in order for t in range(starts[i], starts[i] + q_lens[i])]
        inv = [0] * len(perm)
        for pos, t in enumerate(perm):
            inv[t] = pos
        cum = [0]
        for i in order:
            cum.append(cum[-1] + q_lens[i])
        end = (seq_ids[order[-1]] + 1) * l_row
        if end >= 2**31:
            raise ValueError("cu_seqlens_k would overflow int32: fewer or shorter rows")
        parts.update(perm=perm, inv=inv, cu_q=cum,
                     cu_k=[seq_ids[i] * l_row for i in order] + [end],
                     used_k=[kv_lens[i] for i in order])  # fmt: skip
    # each field starts 16-byte aligned: Triton specialises pointers on 16-byte alignment, so
    # unaligned views would compile new kernels as the batch size changes
    packed: list[int] = []
    offsets = {}
    for name, values in parts.items():
        offsets[name] = len(packed)
        packed += values + [0] * (-len(values) % 4)
    host = torch.tensor(packed, dtype=torch.int32)
    dev = cache.config.device
    flat = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host
    views = {name: flat[at : at + len(parts[name])] for name, at in offsets.items()}
    if paged:
        views["tables"] = views["tables"].view(b, width)
    p = StepPlan(key, max(q_lens), max(kv_lens), views["slots"], views["lens"],
                 views["starts"], views.get("tables"), views.get("perm"), views.get("inv"),
                 views.get("cu_q"), views.get("cu_k"), views.get("used_k"),
                 views.get("mask_starts"))  # fmt: skip
    memo[variant] = p
    cv.plans_built += 1
    return p
