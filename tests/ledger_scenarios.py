"""What each rank of tests/memory/test_ledger.py runs: caches in separate processes drawing pages
from one SharedBudget (host backend under the CUDA page rules), one of them killed."""

import os
import time

import torch.distributed as dist
from caches import SPEC, strict_host

from vmcache import CacheFull, VMKVCache
from vmcache.memory.ledger import SharedBudget
from vmcache.sequences.invariants import check_invariants

TOTAL = 24  # pages in the shared budget
MIN0 = 4  # rank 0's guaranteed minimum


def cache(budget):
    return VMKVCache(SPEC, 8, 256, page_size=4096, pool_bytes=32 * 4096, chunk_pages=4,
                     backend=strict_host(), own_backend=True, budget=budget)  # fmt: skip


def fill(c):
    """Grow new sequences 32 tokens (4 pages) at a time until CacheFull; returns them."""
    seqs = [c.new_sequence()]
    while True:
        if not c.can_grow(seqs[-1], 32):
            try:
                c.grow(seqs[-1], 32)  # can_grow said no: so must grow
            except CacheFull:
                return seqs
            raise AssertionError("can_grow said no and grow succeeded")
        c.grow(seqs[-1], 32)
        if c.seq_len(seqs[-1]) == 256:
            seqs.append(c.new_sequence())


def shared(rank: int, path: str) -> dict:
    pair = dist.new_group([0, 1])  # the ranks left once rank 2 is gone
    if rank == 0:
        budget = SharedBudget(path, TOTAL, min_pages=MIN0)
    dist.barrier()
    if rank:
        budget = SharedBudget(path, max_pages=20)
    c = cache(budget)
    out = {}
    dist.barrier()
    if rank == 2:  # takes what it can, then dies holding it
        fill(c)
        out["held_before_death"] = budget.held
        dist.barrier()  # (1) rank 1 fills next
        dist.barrier()  # (2)
        os._exit(9)
    if rank == 1:
        dist.barrier()  # (1)
        seqs = fill(c)
        snap = budget.snapshot()
        out["after_fill"] = {k: p["held"] for k, p in snap["holders"].items()}
        out["held_1"] = budget.held
        dist.barrier()  # (2)
    if rank == 0:
        dist.barrier()  # (1)
        dist.barrier()  # (2): ranks 1 and 2 hold all but rank 0's minimum
        out["room_0"] = budget.available()
        s = c.new_sequence()
        c.grow(s, 32)  # its guaranteed minimum is there, whatever the others took
        out["held_0"] = budget.held
    # rank 2 is dead now: its pages come back at the next ledger update
    deadline = time.monotonic() + 30
    while len(budget.snapshot()["holders"]) > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    snap = budget.snapshot()
    out["procs_after_death"] = len(snap["holders"])
    out["total_held_after_death"] = sum(p["held"] for p in snap["holders"].values())
    dist.barrier(group=pair)
    if rank == 1:  # what rank 2 held is there to take: rank 1 grows into it
        more = fill(c)
        out["held_1_after"] = budget.held
        for s in seqs + more:
            c.free(s)
        out["trimmed"] = c.elastic.trim()
        out["held_1_trimmed"] = budget.held
    dist.barrier(group=pair)
    if rank == 0:
        out["room_0_after_trim"] = budget.available()
    check_invariants(c)
    for s in c.sequences:
        c.free(s)
    c.close()
    budget.close()
    dist.barrier(group=pair)
    return out
