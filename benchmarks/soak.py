"""Soak run: random new/grow/write/fork/free/swap operations against a plain shadow model, on
both caches, with small pools so that CacheFull happens often. Every operation checks what it
touched; every ``--check-every`` operations all contents and DESIGN.md's invariants are
checked. At the end everything is freed and the pool must be full again (no leaked page).

    python benchmarks/soak.py [--ops 100000] [--seed 0] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import add_out_arg, save, table
from vmcache.paged_fallback import PagedKVCache

from vmcache import CacheFull, KVSpec, VMKVCache

SPEC = KVSpec(2, 2, 8, torch.float32)  # 64 B per token row: 64 tokens per 4 KiB page


def factories(device: str) -> dict:
    return {
        "VMKVCache layer_major": lambda: VMKVCache(
            SPEC, 8, 300, device=device, page_size=4096, pool_bytes=48 * 4096
        ),  # fmt: skip
        "VMKVCache token_major": lambda: VMKVCache(
            SPEC, 8, 300, device=device, page_size=4096, pool_bytes=24 * 4096, layout="token_major"
        ),  # fmt: skip
        "PagedKVCache B=16": lambda: PagedKVCache(
            SPEC, num_blocks=60, block_size=16, device=device, max_seq_len=300, max_seqs=8
        ),  # fmt: skip
    }


def soak(make, ops: int, seed: int = 0, check_every: int = 500) -> dict:
    """Run ``ops`` random operations; returns counts, operations/s and violations."""
    rng = random.Random(seed)
    c = make()
    dev = c.device
    shadow: dict[int, torch.Tensor] = {}  # seq -> [N_L, 2, len, H, D] on the CPU
    swapped: list[tuple[object, torch.Tensor]] = []
    counts = {"cachefull": 0}
    violations: list[str] = []
    value = 0.0

    def read(s):
        return torch.stack([torch.stack(c.kv(layer, s)) for layer in range(SPEC.num_layers)]).cpu()

    def check(s, op):
        if not torch.equal(read(s), shadow[s]):
            violations.append(f"op {i} ({op}): sequence {s} differs from the shadow")

    t0 = time.perf_counter()
    for i in range(ops):
        op = rng.choices(["new", "grow", "write", "fork", "free", "swap_out", "swap_in"],
                         [2, 6, 6, 2, 2, 1, 1])[0]  # fmt: skip
        counts[op] = counts.get(op, 0) + 1
        seqs = sorted(shadow)
        try:
            if op == "new":
                s = c.new_sequence()
                shadow[s] = torch.zeros(SPEC.num_layers, 2, 0, 2, 8)
            elif op == "grow" and seqs:
                s = rng.choice(seqs)
                n = min(rng.randint(1, 70), c.max_seq_len - shadow[s].shape[2])
                c.grow(s, n)
                shadow[s] = torch.cat([shadow[s], torch.zeros(SPEC.num_layers, 2, n, 2, 8)], 2)
                check(s, op)
            elif op == "write" and seqs:
                s = rng.choice(seqs)
                length = shadow[s].shape[2]
                if length:
                    start = rng.randrange(length)
                    n = rng.randint(1, length - start)
                    layer = rng.randrange(SPEC.num_layers)
                    value += 1
                    k = torch.full((n, 2, 8), value)
                    c.write(layer, s, start, k.to(dev), (-k).to(dev))
                    shadow[s][layer, 0, start : start + n] = value
                    shadow[s][layer, 1, start : start + n] = -value
                    check(s, op)
            elif op == "fork" and seqs:
                s = rng.choice(seqs)
                for child in c.fork(s, rng.randint(1, 3)):
                    shadow[child] = shadow[s].clone()
                    check(child, op)
            elif op == "free" and seqs:
                s = rng.choice(seqs)
                c.free(s)
                del shadow[s]
            elif op == "swap_out" and seqs:
                s = rng.choice(seqs)
                swapped.append((c.swap_out(s), shadow.pop(s)))
            elif op == "swap_in" and swapped:
                h, content = swapped[0]
                s = c.swap_in(h)
                swapped.pop(0)
                shadow[s] = content
                check(s, op)
        except CacheFull:
            counts["cachefull"] += 1
        if i % check_every == 0:
            for s in shadow:
                check(s, "periodic")
            try:
                c.check_invariants()
            except AssertionError as exc:
                violations.append(f"op {i}: invariant broken: {exc!r}")
    elapsed = time.perf_counter() - t0
    for s in list(shadow):
        check(s, "final")
        c.free(s)
    st = c.stats()
    leaked = st.total_pages - st.free_pages
    c.check_invariants()
    c.close()
    return {"ops": ops, "ops_per_s": ops / elapsed, "violations": len(violations),
            "leaked_pages": leaked, "first_violations": violations[:5], **counts}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    rows = []
    for name, make in factories(args.device).items():
        r = soak(make, args.ops, args.seed)
        rows.append({"cache": name, **r})
        print(f"{name}: {r['ops']} ops, {r['violations']} violations, {r['leaked_pages']} leaked")
    print(table(rows, ["cache", "ops", "ops_per_s", "violations", "leaked_pages", "cachefull",
                       "fork", "swap_in"]))  # fmt: skip
    print(f"wrote {save('soak', torch.device(args.device), rows, out_dir=args.out)}")
    return rows


if __name__ == "__main__":
    main()
