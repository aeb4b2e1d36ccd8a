"""Decode A/B: contiguous kernels on vmcache memory vs the same kernel on an ordinary tensor
(the upper bound), Triton paged, and the torch reference; latency and effective bandwidth.
FP8 and INT8 K/V (``[fp8]``: e4m3, head scales; ``[int8-token]``: per-token scales) run the
same decode on twins of both caches holding the same K/V: ``vs_bf16`` is their time over the
same impl's at the compute dtype (on a GPU, Triton reading half the bytes; on the CPU, SDPA over
dequantized copies, which costs more than it saves).

    python benchmarks/bench_attention.py [--device cpu|cuda] [--quick]

Effective bandwidth = bytes of K/V read (Σ len · 2 · N_KV · d_h · b) / time. On the CPU, Triton
runs only in its interpreter, whose timings mean nothing, so the CPU grid times the torch paths.
"""

from __future__ import annotations

import dataclasses

import torch
from common import parse_args, save, table, time_repeats

from vmcache import KVSpec, VMKVCache, kernels
from vmcache.kernels import contiguous, triton_decode
from vmcache.kernels.common import sdpa_per_sequence
from vmcache.paged_fallback import PagedKVCache


def filled_caches(dev, spec, batch, ctx, k, v):
    """A VMKVCache and a PagedKVCache each holding ``batch`` sequences of ``ctx`` tokens with
    K/V ``k[b, :ctx]``, ``v[b, :ctx]`` in layer 0; returns (vm, paged, their sequence ids)."""
    max_len = ctx + 1
    vm = VMKVCache(spec, batch, max_len, device=dev,
                   page_size=None if dev.type == "cuda" else 1 << 20)  # fmt: skip
    pg = PagedKVCache(spec, num_blocks=batch * -(-max_len // 16), block_size=16, device=dev,
                      max_seq_len=max_len, max_seqs=batch)  # fmt: skip
    seqs = []
    for c in (vm, pg):
        ids = []
        for b in range(batch):
            s = c.new_sequence()
            c.grow(s, ctx)
            c.write(0, s, 0, k[b, :ctx], v[b, :ctx])
            ids.append(s)
        seqs.append(ids)
    return vm, pg, seqs


def timed_row(name, fn, dev, iters, batch, ctx, kv_bytes=None, **extra) -> dict:
    """``fn`` timed (5 repeats of ``iters`` calls): median µs with its min and max, and the
    effective bandwidth over ``kv_bytes`` read when given."""
    t = time_repeats(fn, dev, repeats=5, iters=iters)
    row = {"impl": name, "batch": batch, "context": ctx, **extra, "us": t["median"] * 1e6,
           "us_min": t["min"] * 1e6, "us_max": t["max"] * 1e6, "repeats": 5}  # fmt: skip
    if kv_bytes is not None:
        row["GB_s"] = kv_bytes / t["median"] / 1e9
    return row


def run_point(dev, spec, batch, ctx, iters) -> list[dict]:
    # the upper bound: the same [S, L, H, D] layout in one ordinary torch allocation
    k_plain = torch.randn(batch, ctx + 1, spec.num_kv_heads, spec.head_dim, device=dev).to(
        spec.dtype
    )
    v_plain = torch.randn_like(k_plain)
    vm, pg, seqs = filled_caches(dev, spec, batch, ctx, k_plain, v_plain)
    q = torch.randn(batch, spec.q_heads, spec.head_dim, device=dev).to(spec.dtype)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    kv_bytes = batch * ctx * 2 * spec.bytes_per_token_per_layer
    cands = {}
    for impl in contiguous.available_impls(q):
        if impl == "triton" and dev.type == "cpu":
            continue
        cands[f"contiguous/{impl} on vmcache"] = lambda i=impl: kernels.decode(
            vm, 0, q, seqs[0], impl=i
        )
    if dev.type == "cuda":
        cands["contiguous/triton on torch.empty"] = lambda: triton_decode.decode(
            q, k_plain, v_plain, slots, lens, max_len=ctx, paged=False, block=1
        )
        cands["paged/triton"] = lambda: kernels.decode(pg, 0, q, seqs[1], impl="triton")
    kvs = [(k_plain[b, :ctx], v_plain[b, :ctx]) for b in range(batch)]
    cands["contiguous/sdpa on torch.empty"] = lambda: sdpa_per_sequence(q, [1] * batch, kvs, None)
    cands["paged/sdpa (gather+sdpa)"] = lambda: kernels.decode(pg, 0, q, seqs[1], impl="sdpa")
    rows = [timed_row(name, fn, dev, iters, batch, ctx, kv_bytes) for name, fn in cands.items()]
    base = {r["impl"].split(" on ")[0]: r["us"] for r in rows if r["impl"].endswith("torch.empty")}
    for r in rows:
        key = r["impl"].split(" on ")[0]
        if r["impl"].endswith("on vmcache") and key in base:
            r["vs_plain"] = r["us"] / base[key]
            plain = next(x for x in rows if x["impl"] == f"{key} on torch.empty")
            # the ratio's effect against the runs' own spread (both timings' min–max)
            noise = max((x["us_max"] - x["us_min"]) / x["us"] for x in (r, plain))
            r["spread_note"] = "spread > effect" if noise > abs(r["vs_plain"] - 1) else ""
    rows += quantized_rows(dev, spec, batch, ctx, iters, q, k_plain, v_plain, rows)
    rows += prefill_rows(dev, spec, batch, ctx, iters, vm, pg, seqs)
    vm.close()
    return rows


PREFILL_CHUNK = 128  # queries a sequence brings in the prefill rows (its last positions)


def prefill_rows(dev, spec, batch, ctx, iters, vm, pg, seqs) -> list[dict]:
    """A chunked prefill of the last :data:`PREFILL_CHUNK` positions of every sequence over
    its whole context: aten FA2 and our Triton prefill on the VM cache, the Triton prefill
    and the gather on the paged one (``vs_fa2``: time over aten FA2's)."""
    n = min(PREFILL_CHUNK, ctx)
    qp = torch.randn(batch * n, spec.q_heads, spec.head_dim, device=dev).to(spec.dtype)
    impls = {"vm": [i for i in contiguous.PREFILL_IMPLS
                    if i == "sdpa" or (dev.type == "cuda" and i in
                                       contiguous.available_impls(qp))],
             "paged": ["triton", "torch"] if dev.type == "cuda" else ["torch"]}  # fmt: skip
    rows = []
    for kind, c, ids in (("vm", vm, seqs[0]), ("paged", pg, seqs[1])):
        for impl in impls[kind]:
            name = (f"prefill {n}: contiguous/{impl} on vmcache" if kind == "vm" else
                    f"prefill {n}: paged/{impl}")  # fmt: skip
            fn = lambda c=c, ids=ids, i=impl: kernels.prefill(c, 0, qp, ids, [n] * batch, impl=i)
            rows.append(timed_row(name, fn, dev, iters, batch, ctx, op="prefill"))
    fa2 = next((r["us"] for r in rows if "aten_fa2" in r["impl"]), None)
    for r in rows:
        if fa2 is not None and "triton" in r["impl"]:
            r["vs_fa2"] = r["us"] / fa2
    return rows


QUANT = {"fp8": (torch.float8_e4m3fn, "head"), "int8-token": (torch.int8, "token")}


def quantized_rows(dev, spec, batch, ctx, iters, q, k_plain, v_plain, base_rows) -> list[dict]:
    """The FP8 / INT8 twins: the cache's own decode path over quantized K/V, and its time
    over the same impl's on the compute-dtype caches (``vs_bf16``)."""
    impl_vm, impl_pg = ("triton", "triton") if dev.type == "cuda" else ("sdpa", "sdpa")
    names = {"vm": f"contiguous/{impl_vm} on vmcache", "paged": "paged/triton"
             if dev.type == "cuda" else "paged/sdpa (gather+sdpa)"}  # fmt: skip
    base = {r["impl"]: r["us"] for r in base_rows}
    rows = []
    for tag, (kv_dtype, granularity) in QUANT.items():
        qspec = dataclasses.replace(spec, kv_dtype=kv_dtype, kv_granularity=granularity)
        vm, pg, ids_of = filled_caches(dev, qspec, batch, ctx, k_plain, v_plain)
        for kind, c, impl, ids in zip(("vm", "paged"), (vm, pg), (impl_vm, impl_pg), ids_of):
            fn = lambda c=c, ids=ids, i=impl: kernels.decode(c, 0, q, ids, impl=i)
            kv_bytes = batch * ctx * 2 * qspec.bytes_per_token_per_layer
            row = timed_row(f"{names[kind]} [{tag}]", fn, dev, iters, batch, ctx, kv_bytes)
            rows.append({**row, "vs_bf16": row["us"] / base[names[kind]]})
        vm.close()
    return rows


def plot(rows, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    batch = max(r["batch"] for r in rows)
    for impl in sorted({r["impl"] for r in rows}):
        pts = sorted(
            (r["context"], r["us"]) for r in rows if r["impl"] == impl and r["batch"] == batch
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode µs / layer",
           title=f"decode latency, batch {batch}")  # fmt: skip
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return path


def main(argv=None):
    args, dev = parse_args(__doc__, argv)
    if dev.type == "cuda":
        spec = KVSpec(1, 8, 128, torch.bfloat16, num_q_heads=32)
        grid = [(b, c) for b in (1, 8, 32, 64) for c in (512, 2048, 8192, 32768)]
        iters = 50
    else:
        spec = KVSpec(1, 8, 128, torch.float32, num_q_heads=32)
        grid = [(b, c) for b in (1, 8) for c in (512, 2048)]
        iters = 5 if args.quick else 10
    if args.quick and dev.type == "cuda":
        grid = [(1, 2048), (32, 8192)]
    rows = []
    for b, c in grid:
        rows += run_point(dev, spec, b, c, iters)
    print(table(rows, ["impl", "batch", "context", "us", "GB_s", "vs_plain", "vs_bf16"]))
    path = save("bench_attention", dev, rows, {"spec": str(spec)}, out_dir=args.out)
    png = plot(rows, path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return rows


if __name__ == "__main__":
    main()
