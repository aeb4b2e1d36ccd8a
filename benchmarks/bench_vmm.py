"""Virtual-memory costs: map+unmap per page size, grow, fork vs copying the prompt, scrubbing.

python benchmarks/bench_vmm.py [--device cpu|cuda] [--quick]
"""

from __future__ import annotations

import time

import torch
from common import parse_args, save, table, time_repeats

from vmcache import KVSpec, VMKVCache
from vmcache.memory.backends import make_backend


def map_unmap(device: torch.device, page_sizes: list[int], n: int) -> list[dict]:
    rows = []
    with make_backend(device) as be:
        for P in page_sizes:
            va = be.reserve(n * P)
            handles = [be.create_page(P) for _ in range(n)]
            t0 = time.perf_counter()
            for i, h in enumerate(handles):
                be.map(va + i * P, [h], P)
            t1 = time.perf_counter()
            be.unmap(va, n, P)
            t2 = time.perf_counter()
            for h in handles:
                be.release_page(h)
            be.release_reservation(va, n * P)
            rows.append({"op": "map+unmap", "page_size": P, "map_us": (t1 - t0) / n * 1e6,
                         "unmap_us": (t2 - t1) / n * 1e6})  # fmt: skip
    return rows


def cache_ops(device: torch.device, page_size: int, prompt: int) -> list[dict]:
    spec = KVSpec(2, 8, 128, torch.bfloat16)  # Llama-3-8B shape, 2 layers
    rows = []
    with VMKVCache(spec, 8, 4096, device=device, page_size=page_size) as c:
        s = c.new_sequence()
        t0 = time.perf_counter()
        for _ in range(prompt):
            c.grow(s, 1)
        per_token = (time.perf_counter() - t0) / prompt
        k = torch.randn(prompt, 8, 128, device=device).to(spec.dtype)
        for layer in range(2):
            c.write(layer, s, 0, k, k)

        def fork_free():
            (child,) = c.fork(s, 1)
            c.free(child)

        def copy_prompt():
            return [t.clone() for layer in range(2) for t in c.kv(layer, s)]

        fork, copy = (
            time_repeats(fn, device, repeats=5, iters=20) for fn in (fork_free, copy_prompt)
        )
        t_fork, t_copy = fork["median"], copy["median"]
        rows.append({"op": "grow by 1 token (avg)", "page_size": page_size, "us": per_token * 1e6})
        rows.append({"op": f"fork+free {prompt}-token prompt", "page_size": page_size,
                     "us": t_fork * 1e6, "us_min": fork["min"] * 1e6,
                     "us_max": fork["max"] * 1e6})  # fmt: skip
        rows.append({"op": f"copy {prompt}-token prompt K/V", "page_size": page_size,
                     "us": t_copy * 1e6, "us_min": copy["min"] * 1e6, "us_max": copy["max"] * 1e6,
                     "fork_vs_copy": t_fork / t_copy})  # fmt: skip
    for scrub in (True, False):
        with VMKVCache(spec, 8, 4096, device=device, page_size=page_size,
                       scrub_on_reuse=scrub) as c:  # fmt: skip
            s = c.new_sequence()
            c.grow(s, prompt)
            c.free(s)  # pages are now used: reallocation scrubs them when asked to
            s = c.new_sequence()
            t0 = time.perf_counter()
            c.grow(s, prompt)
            t = time.perf_counter() - t0
            rows.append({"op": f"re-grow {prompt} tokens, scrub={scrub}", "page_size": page_size,
                         "us": t * 1e6})  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    args, dev = parse_args(__doc__, argv)
    if dev.type == "cuda":
        g = make_backend(dev).granularity
        sizes = [g, 2 * g, 4 * g]
    else:
        sizes = [4096, 65536, 2 << 20]
    n = 32 if args.quick else 256
    rows = map_unmap(dev, sizes, n)
    print(table(rows, ["op", "page_size", "map_us", "unmap_us"]))
    ops = []
    for P in [sizes[0]] if dev.type == "cuda" else [65536, 2 << 20]:
        ops += cache_ops(dev, P, 1000 if not args.quick else 300)
    print(table(ops, ["op", "page_size", "us", "fork_vs_copy"]))
    path = save("bench_vmm", dev, rows + ops, out_dir=args.out)
    print(f"wrote {path}")
    return rows + ops


if __name__ == "__main__":
    main()
