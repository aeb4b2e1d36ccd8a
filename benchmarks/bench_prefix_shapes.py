"""Prefix caching over every head shape: what sharing in blocks of whole tokens costs.

    python benchmarks/bench_prefix_shapes.py [--quick]      (make bench-prefix-shapes)

A token row that does not divide the page (SmolLM2: 3 KV heads x 64 x fp32 = 768 bytes) is
shared in blocks of k = lcm(page, row) / page pages ending on a whole token
(vmcache.prefix.index). For each shape of the grid (head_dim 64/80/96/128/256 x KV heads 1-12
x fp32 / bf16 / FP8 / FP8 with per-token scales, both layouts, 32 layers) on the host's pages
(64 KiB) and CUDA's (2 MiB), the real cache bookkeeping (the sizing backend: page tables,
refcounts and the prefix index run for real, no bytes) replays a shared-prompt trace: 8
requests of a 2,048-token system prompt and 64 tokens of their own, each admitted after the
previous one indexed its prompt. Recorded: tokens per block, prompt tokens the 7 later
requests found cached (of 7 x 2,048 shareable), pages and waste per sequence (mapped minus
used bytes), and beside it the alternative the blocks replace, one page enlarged to
lcm(granularity, row) bytes: its tokens per page and its worst waste per sequence.

Bookkeeping only: no K/V is written or read, so no time is measured; the figures hold on
any machine.
"""

from __future__ import annotations

import itertools
import math
import statistics

import torch
from common import add_out_arg, save, table

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends.sizing import SizingBackend

HEAD_DIMS = (64, 80, 96, 128, 256)
KV_HEADS = (1, 2, 3, 4, 5, 6, 8, 12)
STORAGES = {"fp32": (torch.float32, None, "head"), "bf16": (torch.bfloat16, None, "head"),
            "fp8": (torch.bfloat16, torch.float8_e4m3fn, "head"),
            "fp8-token": (torch.bfloat16, torch.float8_e4m3fn, "token")}  # fmt: skip
BACKENDS = {"host-64K": (4096, 64 << 10), "cuda-2M": (2 << 20, 2 << 20)}  # granule, page
LAYERS, SYSTEM, OWN, REQUESTS = 32, 2048, 64, 8


def one(head_dim, kv_heads, storage, layout, backend) -> dict:
    dtype, kv_dtype, gran = STORAGES[storage]
    spec = KVSpec(num_layers=LAYERS, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                  kv_dtype=kv_dtype, kv_granularity=gran)  # fmt: skip
    granule, page = BACKENDS[backend]
    be = SizingBackend(granularity=granule, page_size=page)
    system = [(13 * i + 5) % 30_000 for i in range(SYSTEM)]
    hits, pages, waste = [], [], []
    with VMKVCache(spec, REQUESTS, SYSTEM + OWN, layout=layout, backend=be, own_backend=True,
                   prefix_caching=True) as c:  # fmt: skip
        row = spec.bytes_per_token_per_layer * (LAYERS if layout == "token_major" else 1)
        ix = c.prefix.index
        for r in range(REQUESTS):
            tokens = system + [30_000 + r] * OWN
            s = c.new_sequence(prefix_tokens=tokens)
            hit = c.seq_len(s)
            c.grow(s, len(tokens) - hit, token_ids=tokens[hit:])
            c.prefix.publish(s)
            if r:
                hits.append(hit)
            tables = 2 * LAYERS if layout == "layer_major" else 2
            mapped = tables * -(-len(tokens) * row // c.config.page_bytes)
            pages.append(mapped)
            waste.append(mapped * c.config.page_bytes - len(tokens) * spec.bytes_per_token)
        st = c.stats()
        physical = st.physical_pages
    enlarged = math.lcm(granule, row)
    big = -(-page // enlarged) * enlarged  # the least whole-token page >= the default
    big_pages = tables * -(-(SYSTEM + OWN) * row // big)
    return {"head_dim": head_dim, "kv_heads": kv_heads, "storage": storage, "layout": layout,
            "backend": backend, "row_bytes": row, "page_bytes": c.config.page_bytes,
            "pages_per_block": ix.pages_per_table, "tokens_per_block": ix.tokens_per_entry,
            "hit_tokens": sum(hits), "shareable_tokens": (REQUESTS - 1) * SYSTEM,
            "hit_pct": 100 * sum(hits) / ((REQUESTS - 1) * SYSTEM),
            "pages_per_seq": statistics.median(pages), "physical_pages": physical,
            "waste_bytes_per_seq": max(waste),
            "enlarged_page_bytes": big, "enlarged_tokens_per_page": big // row,
            "enlarged_waste_bytes_per_seq": big_pages * big - (SYSTEM + OWN)
            * spec.bytes_per_token}  # fmt: skip


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="head_dim 64/80, 1-3 KV heads")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    dims, heads = ((64, 80), (1, 2, 3)) if args.quick else (HEAD_DIMS, KV_HEADS)
    rows = []
    grid = itertools.product(BACKENDS, ("layer_major", "token_major"), dims, heads, STORAGES)
    for be, lay, d, h, st in grid:
        try:
            rows.append(one(d, h, st, lay, be))
        except (ValueError, TypeError) as exc:  # recorded: the verdict counts it
            where = {"head_dim": d, "kv_heads": h, "storage": st, "layout": lay, "backend": be}
            rows.append({**where, "error": str(exc)})
    rows_ok = [r for r in rows if "error" not in r]
    print(table([r for r in rows_ok if r["kv_heads"] in (3, 8)],
                ["backend", "layout", "head_dim", "kv_heads", "storage", "row_bytes",
                 "pages_per_block", "tokens_per_block", "hit_pct", "waste_bytes_per_seq",
                 "enlarged_tokens_per_page", "enlarged_waste_bytes_per_seq"]))  # fmt: skip
    path = save("prefix_shapes", torch.device("cpu"), rows,
                {"layers": LAYERS, "system_tokens": SYSTEM, "own_tokens": OWN,
                 "requests": REQUESTS}, out_dir=args.out)  # fmt: skip
    print(f"saved {path}")
    return rows


if __name__ == "__main__":
    main()
