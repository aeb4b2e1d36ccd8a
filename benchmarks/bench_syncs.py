"""Host↔device round trips per decode step, both caches: what the cache and the kernels cost
besides the kernels themselves. Goal: at most one upload and no synchronisation per step.

A decode step here is what the engine does per step: grow every sequence by one token, then
per layer write its K/V and run decode attention. Counted per step:

- ``backend_syncs``: the cache's ``synchronize`` calls (VMKVCache, through a counting
  StrictBackend; it syncs only before unmapping pages a kernel may still read),
- ``plan_uploads``: per-step metadata uploads (``vmcache.kernels.plan``: one int32 buffer),
- on CUDA also, from the torch profiler, ``cudaMemcpy*`` and ``*Synchronize`` runtime calls
  (these include the test loop's own K/V uploads, listed apart as ``kv_uploads``).

    python benchmarks/bench_syncs.py [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the CPU run counts through the interpreted Triton path
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common import parse_args, save, table  # noqa: E402

from vmcache import KVSpec, VMKVCache, kernels  # noqa: E402
from vmcache.memory.backends import make_backend  # noqa: E402
from vmcache.memory.backends.strict import StrictBackend  # noqa: E402
from vmcache.paged_fallback import PagedKVCache  # noqa: E402


def make(kind: str, spec: KVSpec, dev: torch.device, batch: int, max_len: int):
    if kind == "paged":
        blocks = batch * -(-max_len // 16)
        return PagedKVCache(spec, num_blocks=blocks, block_size=16, device=dev,
                            max_seq_len=max_len, max_seqs=batch)  # fmt: skip
    inner = make_backend(dev)
    be = StrictBackend(inner, inner.granularity)  # counts syncs; the device's own granularity
    page = be.granularity if dev.type == "cuda" else 64 << 10
    layout = "token_major" if kind == "vm_token_major" else "layer_major"
    return VMKVCache(spec, batch, max_len, backend=be, own_backend=True, page_size=page,
                     layout=layout)  # fmt: skip


def cuda_calls(prof) -> dict:
    names = {"sync": ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
             "memcpy": ("cudaMemcpy", "cudaMemcpyAsync")}  # fmt: skip
    out = {k: 0 for k in names}
    for e in prof.events():
        for k, ns in names.items():
            if e.name in ns:
                out[k] += 1
    return out


def run(kind: str, dev: torch.device, steps: int, batch: int = 8, layers: int = 4) -> dict:
    spec = KVSpec(layers, 8, 128, torch.bfloat16 if dev.type == "cuda" else torch.float32, 32)
    c = make(kind, spec, dev, batch, 1024)
    seqs = [c.new_sequence() for _ in range(batch)]
    for i, s in enumerate(seqs):
        c.grow(s, 100 + 37 * i)
    kv = torch.randn(1, spec.num_kv_heads, spec.head_dim, device=dev).to(spec.dtype)
    q = torch.randn(batch, spec.q_heads, spec.head_dim, device=dev).to(spec.dtype)
    be = getattr(c, "_backend", None)
    impl = None if dev.type == "cuda" else "triton"  # the path that plans, interpreted on CPU

    def step():
        for s in seqs:
            c.grow(s, 1)
        for layer in range(layers):
            for s in seqs:
                c.write(layer, s, c.seq_len(s) - 1, kv, kv)
            kernels.decode(c, layer, q, seqs, impl=impl)

    step()  # warm up (first plan, compilation)
    sync0, plans0 = getattr(be, "sync_calls", 0), c.stats().plans_built
    row = {"cache": kind, "steps": steps, "batch": batch, "layers": layers}
    if dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        calls = cuda_calls(prof)
        row["cuda_syncs_per_step"] = calls["sync"] / steps
        row["cuda_memcpy_per_step"] = calls["memcpy"] / steps
    else:
        for _ in range(steps):
            step()
    row["backend_syncs_per_step"] = (getattr(be, "sync_calls", 0) - sync0) / steps
    row["plan_uploads_per_step"] = (c.stats().plans_built - plans0) / steps
    row["kv_uploads_per_step"] = 0  # kv is created once on the device above
    c.close()
    return row


def main(argv=None):
    args, dev = parse_args(__doc__, argv)
    steps = 8 if args.quick else 32
    small = dict(batch=4, layers=2) if dev.type == "cpu" else {}
    rows = [run(kind, dev, steps, **small) for kind in ("vm", "vm_token_major", "paged")]
    cols = ["cache", "steps", "backend_syncs_per_step", "plan_uploads_per_step"]
    if dev.type == "cuda":
        cols += ["cuda_syncs_per_step", "cuda_memcpy_per_step"]
    print(table(rows, cols))
    for r in rows:
        r["verdict"] = ("agrees" if r["backend_syncs_per_step"] == 0
                        and r["plan_uploads_per_step"] <= 1 else "DIFFERS")  # fmt: skip
    print(f"wrote {save('syncs', dev, rows, out_dir=args.out)}")
    return rows


if __name__ == "__main__":
    main()
