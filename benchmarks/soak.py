"""Soak run: random new/grow/write/fork/free/swap operations against a plain shadow model, on
both caches, with small pools so that CacheFull happens often. Every operation checks what it
touched; every ``--check-every`` operations all contents and docs/DESIGN.md's invariants are
checked. At the end everything is freed and the pool must be full again (no leaked page).

    python benchmarks/soak.py [--ops 100000] [--seed 0] [--device cpu|cuda] [--strict]

Pages are the backend's own size (the driver's 2 MiB granularity on CUDA, 4 KiB on the host)
and the model's head_dim scales with them, so a page always holds 64 tokens of one table.
``--strict`` runs the host backend under the CUDA page rules at 2 MiB (StrictBackend).
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import add_out_arg, save, table

from vmcache import CacheFull, KVSpec, VMKVCache
from vmcache.memory.backends import make_backend
from vmcache.memory.backends.host import HostBackend
from vmcache.memory.backends.strict import CUDA_GRANULARITY, StrictBackend
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants


def spec_for(page_size: int) -> KVSpec:
    """2 layers, 2 KV heads, fp32, head_dim = page/512: 64 tokens per page and table row."""
    return KVSpec(2, 2, page_size // 512, torch.float32)


def factories(device: str, strict: bool = False) -> dict:
    """Cache makers; each takes no argument and has a ``.spec``. The backend decides the page
    size: CUDA's granularity on a GPU, 4 KiB on the host, 2 MiB with ``strict``."""

    def backend():
        return StrictBackend(HostBackend()) if strict else make_backend(device)

    probe = backend()
    page = CUDA_GRANULARITY if strict else (4096 if device == "cpu" else probe.granularity)
    probe.close()
    spec = spec_for(page)

    def vm(pages, layout):
        return lambda: VMKVCache(
            spec, 8, 300, backend=backend(), own_backend=True, page_size=page,
            pool_bytes=pages * page, layout=layout,
        )  # fmt: skip

    makers = {
        "VMKVCache layer_major": vm(48, "layer_major"),
        "VMKVCache token_major": vm(24, "token_major"),
        "PagedKVCache B=16": lambda: PagedKVCache(
            spec, num_blocks=60, block_size=16, device=device, max_seq_len=300, max_seqs=8
        ),  # fmt: skip
    }
    for make in makers.values():
        make.spec = spec
    return makers


def check_all(c, seqs, check, violations: list[str], where: str) -> None:
    """Every live sequence's contents, then the cache's invariants."""
    for s in seqs:
        check(s, "periodic")
    try:
        check_invariants(c)
    except AssertionError as exc:
        violations.append(f"{where}: invariant broken: {exc!r}")


def finish(c, seqs, check) -> int:
    """Final content checks, free everything (and the prefix index), close; returns the
    pages still held (leaked)."""
    for s in list(seqs):
        check(s, "final")
        c.free(s)
    if c.prefix.index is not None:
        c.prefix.index.clear()
    st = c.stats()
    check_invariants(c)
    c.close()
    return st.total_pages - st.free_pages


def soak(make, ops: int, seed: int = 0, check_every: int = 500) -> dict:
    """Run ``ops`` random operations; returns counts, operations/s and violations."""
    rng = random.Random(seed)
    c = make()
    dev = c.config.device
    spec = c.spec
    H, D = spec.num_kv_heads, spec.head_dim
    shadow: dict[int, torch.Tensor] = {}  # seq -> [N_L, 2, len, H, D] on the CPU
    swapped: list[tuple[object, torch.Tensor]] = []
    dirty: set[int] = set()  # truncated: regrown positions may hold the sequence's old bytes
    counts = {"cachefull": 0, "pool_full": 0, "slots_full": 0}  # CacheFull, and why
    done: dict[str, int] = {}  # operations that completed (``counts[op]``: chosen)
    violations: list[str] = []
    value = 0.0

    def put(group, layers, start, n, grouped=False):
        """Write a fresh value at positions [start, start+n) of ``layers`` in every sequence
        of ``group`` (one ``write_group`` call per layer if ``grouped``, else ``write`` into
        the only member), and record it in the shadow after each successful call."""
        nonlocal value
        value += 1
        x = torch.full((n, H, D), value)
        for layer in layers:
            if grouped:
                c.beams.write_group(layer, group, start, x.to(dev), (-x).to(dev))
            else:
                c.write(layer, group[0], start, x.to(dev), (-x).to(dev))
            for s in group:
                shadow[s][layer, 0, start : start + n] = value
                shadow[s][layer, 1, start : start + n] = -value

    def read(s):
        return torch.stack([torch.stack(c.kv(layer, s)) for layer in range(spec.num_layers)]).cpu()

    def check(s, op):
        if not torch.equal(read(s), shadow[s]):
            violations.append(f"op {i} ({op}): sequence {s} differs from the shadow")

    t0 = time.perf_counter()
    for i in range(ops):
        op = rng.choices(["new", "grow", "write", "fork", "free", "swap_out", "swap_in",
                          "assign", "truncate", "reserve", "write_group"],
                         [2, 6, 6, 2, 2, 1, 1, 1, 1, 1, 2])[0]  # fmt: skip
        counts[op] = counts.get(op, 0) + 1
        seqs = sorted(shadow)
        try:
            if op == "new":
                s = c.new_sequence()
                shadow[s] = torch.zeros(spec.num_layers, 2, 0, H, D)
            elif op == "grow" and seqs:
                s = rng.choice(seqs)
                n = min(rng.randint(1, 70), c.config.max_seq_len - shadow[s].shape[2])
                c.grow(s, n)
                shadow[s] = torch.cat([shadow[s], torch.zeros(spec.num_layers, 2, n, H, D)], 2)
                if s in dirty and n:  # unknown bytes (a truncated tail): make them known
                    try:
                        put([s], range(spec.num_layers), shadow[s].shape[2] - n, n)
                    except CacheFull:
                        c.beams.truncate(s, shadow[s].shape[2] - n)  # undo the grow
                        shadow[s] = shadow[s][:, :, :-n].clone()
                        raise
                check(s, op)
            elif op == "write" and seqs:
                s = rng.choice(seqs)
                length = shadow[s].shape[2]
                if length:
                    start = rng.randrange(length)
                    n = rng.randint(1, length - start)
                    put([s], [rng.randrange(spec.num_layers)], start, n)
                    check(s, op)
            elif op == "fork" and seqs:
                s = rng.choice(seqs)
                for child in c.fork(s, rng.randint(1, 3)):
                    shadow[child] = shadow[s].clone()
                    if s in dirty:
                        dirty.add(child)
                    check(child, op)
            elif op == "free" and seqs:
                s = rng.choice(seqs)
                c.free(s)
                del shadow[s]
                dirty.discard(s)
            elif op == "swap_out" and seqs:
                s = rng.choice(seqs)
                swapped.append((c.swap.out(s), shadow.pop(s)))
                dirty.discard(s)
            elif op == "swap_in" and swapped:
                h, content = swapped[0]
                s = c.swap.restore(h)
                swapped.pop(0)
                shadow[s] = content
                check(s, op)
            elif op == "assign" and seqs:
                dsts = rng.sample(seqs, rng.randint(1, min(3, len(seqs))))
                srcs = [rng.choice(seqs) for _ in dsts]
                c.beams.assign(dsts, srcs)
                before = {x: (shadow[x].clone(), x in dirty) for x in srcs}
                for d, x in zip(dsts, srcs):
                    shadow[d] = before[x][0].clone()
                    (dirty.add if before[x][1] else dirty.discard)(d)
                for d in dsts:
                    check(d, op)
            elif op == "truncate" and seqs:
                s = rng.choice(seqs)
                length = rng.randint(0, shadow[s].shape[2])
                c.beams.truncate(s, length)
                shadow[s] = shadow[s][:, :, :length].clone()
                dirty.add(s)
                check(s, op)
            elif op == "reserve" and seqs:
                s = rng.choice(seqs)
                c.allocate(s, 0, ahead=rng.randint(1, 100))  # best effort, changes no content
                check(s, op)
            elif op == "write_group" and seqs:
                live = [x for x in seqs if shadow[x].shape[2]]
                if live:
                    group = rng.sample(live, rng.randint(1, min(3, len(live))))
                    length = min(shadow[x].shape[2] for x in group)
                    start = rng.randrange(length)
                    n = rng.randint(1, length - start)
                    put(group, [rng.randrange(spec.num_layers)], start, n, grouped=True)
                    for x in group:
                        check(x, op)
            else:
                continue
            done[op] = done.get(op, 0) + 1
        except CacheFull:
            counts["cachefull"] += 1
            slots_short = op in ("new", "fork") and c.capacity.free_slots < 3
            counts["slots_full" if slots_short else "pool_full"] += 1
        if i % check_every == 0:
            check_all(c, shadow, check, violations, f"op {i}")
    elapsed = time.perf_counter() - t0
    leaked = finish(c, shadow, check)
    return {"ops": ops, "ops_per_s": ops / elapsed, "violations": len(violations),
            "leaked_pages": leaked, "first_violations": violations[:5], **counts,
            "done": done}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--strict", action="store_true", help="host backend under CUDA page rules")
    add_out_arg(ap)
    args = ap.parse_args(argv)
    rows = []
    for name, make in factories(args.device, args.strict).items():
        r = soak(make, args.ops, args.seed)
        rows.append({"cache": name, **r})
        print(f"{name}: {r['ops']} ops, {r['violations']} violations, {r['leaked_pages']} leaked")
    print(table(rows, ["cache", "ops", "ops_per_s", "violations", "leaked_pages", "pool_full",
                       "slots_full"]))  # fmt: skip
    print(f"wrote {save('soak', torch.device(args.device), rows, out_dir=args.out)}")
    return rows


if __name__ == "__main__":
    main()
