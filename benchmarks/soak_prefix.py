"""Prefix-caching soak: random operations on caches with prefix caching on, where K/V are a
function of (token, position), so a page reused under the wrong prefix, a stale cached page or
a lost write shows as a content mismatch. Prompts are drawn from a few recurring page-sized
chunks, so lookups hit often; the pool is small, so cached pages are evicted often.

    python benchmarks/soak_prefix.py [--ops 20000] [--seed 0]

Operations: new (with prefix_tokens: maps the cached pages), append (grow with token ids, then
write), fork, assign, truncate, free (indexes its full pages), cache_prefix, swap_out, swap_in,
evict. Every touched sequence is checked against its tokens; everything, with the invariants,
every ``check_every`` operations; at the end the index is cleared and no page may be held.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from common import add_out_arg, save, table
from soak import check_all, finish

from vmcache import CacheFull, KVSpec, VMKVCache
from vmcache.paged_fallback import PagedKVCache

SPEC = KVSpec(2, 2, 16, torch.float32)  # 128 B token rows: 32 tokens per 4 KiB page


def kv_of(tokens: list[int], start: int = 0) -> torch.Tensor:
    """K (V = −K) of ``tokens`` at positions start...: ``[n, 2, 16]``."""
    ids = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)
    return (ids + 1000 * pos)[:, None, None].expand(len(tokens), 2, 16).contiguous()


def factories() -> dict:
    return {
        "VMKVCache layer_major": lambda: VMKVCache(
            SPEC, 6, 160, page_size=4096, pool_bytes=48 * 4096, prefix_caching=True
        ),  # fmt: skip
        "VMKVCache token_major": lambda: VMKVCache(
            SPEC,
            6,
            160,
            page_size=4096,
            pool_bytes=24 * 4096,
            layout="token_major",
            prefix_caching=True,
        ),  # fmt: skip
        "PagedKVCache B=16": lambda: PagedKVCache(
            SPEC, num_blocks=24, block_size=16, max_seq_len=160, max_seqs=6, prefix_caching=True
        ),  # fmt: skip
    }


def soak(make, ops: int, seed: int = 0, check_every: int = 200) -> dict:
    rng = random.Random(seed)
    c = make()
    P = c.prefix.tokens_per_entry
    chunks = [[0] * P, [1] * P, [0, 1] * (P // 2), [2] * P]
    tokens: dict[int, list[int]] = {}
    swapped: list[tuple[object, list[int]]] = []
    done: dict[str, int] = {}
    counts = {"pool_full": 0, "slots_full": 0, "lookups": 0, "hits": 0, "hit_tokens": 0}
    violations: list[str] = []

    def prompt(max_pages: int) -> list[int]:
        pages = [t for _ in range(rng.randint(1, max_pages)) for t in rng.choice(chunks[:3])]
        return pages + [rng.randint(0, 2) for _ in range(rng.randint(1, P))]

    def append(s: int, ids: list[int]) -> None:
        start = c.seq_len(s)
        c.grow(s, len(ids), token_ids=ids)
        try:
            k = kv_of(ids, start)
            for layer in range(SPEC.num_layers):
                c.write(layer, s, start, k, -k)
        except CacheFull:
            c.beams.truncate(s, start)  # the grow succeeded, a copy-on-write did not: undo it
            raise
        tokens[s] = tokens[s] + ids

    def check(s: int, op: str) -> None:
        want = kv_of(tokens[s])
        for layer in range(SPEC.num_layers):
            k, v = c.kv(layer, s)
            if not (torch.equal(k, want) and torch.equal(v, -want)):
                violations.append(f"op {i} ({op}): sequence {s} layer {layer} differs")
                return

    t0 = time.perf_counter()
    for i in range(ops):
        op = rng.choices(["new", "append", "fork", "assign", "truncate", "free",
                          "cache_prefix", "swap_out", "swap_in", "evict"],
                         [4, 5, 1, 1, 1, 3, 1, 1, 1, 1])[0]  # fmt: skip
        seqs = sorted(tokens)
        try:
            if op == "new":
                ids = prompt(4)
                s = c.new_sequence(prefix_tokens=ids)
                n = c.seq_len(s)
                counts["lookups"] += 1
                counts["hits"] += n > 0
                counts["hit_tokens"] += n
                tokens[s] = ids[:n]
                check(s, op)
                if len(ids) > n:
                    append(s, ids[n:])
                    check(s, op)
            elif op == "append" and seqs:
                s = rng.choice(seqs)
                ids = prompt(1)
                if len(tokens[s]) + len(ids) > c.config.max_seq_len:
                    continue
                append(s, ids)
                check(s, op)
            elif op == "fork" and seqs:
                s = rng.choice(seqs)
                (kid,) = c.fork(s)
                tokens[kid] = list(tokens[s])
                check(kid, op)
            elif op == "assign" and seqs:
                dsts = rng.sample(seqs, rng.randint(1, min(2, len(seqs))))
                srcs = [rng.choice(seqs) for _ in dsts]
                before = {x: list(tokens[x]) for x in srcs}
                c.beams.assign(dsts, srcs)
                for d, x in zip(dsts, srcs):
                    tokens[d] = list(before[x])
                    check(d, op)
            elif op == "truncate" and seqs:
                s = rng.choice(seqs)
                n = rng.randint(0, len(tokens[s]))
                c.beams.truncate(s, n)
                tokens[s] = tokens[s][:n]
                check(s, op)
            elif op == "free" and seqs:
                s = rng.choice(seqs)
                c.free(s)
                del tokens[s]
            elif op == "cache_prefix" and seqs:
                c.prefix.publish(rng.choice(seqs))
            elif op == "swap_out" and seqs:
                s = rng.choice(seqs)
                swapped.append((c.swap.out(s), tokens.pop(s)))
            elif op == "swap_in" and swapped:
                h, ids = swapped[0]
                s = c.swap.restore(h)
                swapped.pop(0)
                tokens[s] = ids
                check(s, op)
            elif op == "evict":
                c.prefix.index.reclaim(rng.randint(1, 8))
            else:
                continue
            done[op] = done.get(op, 0) + 1
        except CacheFull:
            slots_short = op in ("new", "fork") and not c.capacity.free_slots
            counts["slots_full" if slots_short else "pool_full"] += 1
        if i % check_every == 0:
            check_all(c, tokens, check, violations, f"op {i}")
    elapsed = time.perf_counter() - t0
    leaked = finish(c, tokens, check)
    return {"ops": ops, "ops_per_s": ops / elapsed, "violations": len(violations),
            "leaked_pages": leaked, "first_violations": violations[:5],
            **counts, "done": done}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    rows = [{"cache": name, **soak(make, args.ops, args.seed)}
            for name, make in factories().items()]  # fmt: skip
    print(table(rows, ["cache", "ops", "ops_per_s", "violations", "leaked_pages", "hits",
                       "lookups", "pool_full"]))  # fmt: skip
    print(f"wrote {save('soak_prefix', torch.device('cpu'), rows, out_dir=args.out)}")
    return rows


if __name__ == "__main__":
    main()
