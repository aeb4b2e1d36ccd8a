"""What each rank of tests/distributed/test_transfer.py runs (spawned processes import this module).

Rank 0 builds sequences and sends them; rank 1 receives. Each returns what the test asserts
on: per scenario, the K/V and state a sequence had on the sender and what arrived, and
snapshots of both caches around every refused or failed hand-off.
"""

import os

import torch
import torch.distributed as dist
from caches import WINDOWED, paged, vm

from vmcache import CacheFull
from vmcache.distributed import TransferError, recv_sequence, send_sequence
from vmcache.distributed import handoff as wire
from vmcache.sequences.invariants import check_invariants

KINDS = {
    "vm": lambda **kw: vm(pages=96, **kw),
    "vm_token_major": lambda **kw: vm(pages=96, layout="token_major", **kw),
    "paged": lambda **kw: paged(blocks=48, **kw),
}
CASES = ["plain", "forked_child", "forked_parent", "prefix_shared", "windowed"]


def state(c) -> dict:
    """Everything a hand-off could change: stats (pages, refcounts in use), tables, K/V."""
    layers = range(c.spec.num_layers)
    return {
        "stats": c.stats(),
        "refcounts": [c._pool.refcount(p) for p in range(c._pool.num_pages)],
        "seqs": {s: (c.handoff.manifest(s), c.views.page_table(s)) for s in c.sequences},
        "kv": {s: [torch.cat(c.kv(layer, s)).clone() for layer in layers] for s in c.sequences},
    }


def content(c, s) -> dict:
    layers = range(c.spec.num_layers)
    m = c.handoff.manifest(s)
    return {"manifest": (m.length, m.firsts, m.token_ids, m.salt),
            "window_starts": [c.views.window_start(layer, s) for layer in layers],
            "kv": [torch.cat(c.kv(layer, s)).clone() for layer in layers]}  # fmt: skip


def fill(c, s, n, gen, chunk=8):
    """Grow ``s`` by ``n`` tokens (with ids) in chunks, writing random K/V into every layer."""
    shape = (c.spec.num_kv_heads, c.spec.head_dim)
    done = c.seq_len(s)
    while n > 0:
        k = min(chunk, n)
        c.grow(s, k, token_ids=torch.randint(0, 100, (k,), generator=gen).tolist())
        for layer in range(c.spec.num_layers):
            kv = torch.randn((2, k) + shape, generator=gen, dtype=c.spec.dtype)
            c.write(layer, s, done, kv[0], kv[1])
        done, n = done + k, n - k


def build(kind, case, gen):
    """A sender cache holding the case's sequence; returns (cache, the sequence to send)."""
    if case == "windowed":
        c = KINDS[kind](spec=WINDOWED, rollback_tokens=2)
        s = c.new_sequence(salt="tenant-a")
        fill(c, s, 70, gen)  # layer 0's window (8) released its first pages
        return c, s
    if case == "prefix_shared":
        c = KINDS[kind](prefix_caching=True)
        a = c.new_sequence(salt="tenant-a")
        fill(c, a, 70, gen)
        c.prefix.publish(a)
        b = c.new_sequence(prefix_tokens=c.handoff.manifest(a).token_ids[:66], salt="tenant-a")
        fill(c, b, 9, gen)  # b maps a's full pages (shared), then its own
        return c, b
    c = KINDS[kind]()
    s = c.new_sequence(salt=7)  # an int salt: the wire encodes None, str, bytes, int
    fill(c, s, 45, gen)
    if case.startswith("forked"):
        (child,) = c.fork(s)
        k = torch.ones((1, c.spec.num_kv_heads, c.spec.head_dim), dtype=c.spec.dtype)
        c.write(0, child, 44, k, k)  # copy-on-write of the shared tail page
        fill(c, child, 5, gen)
        return c, child if case == "forked_child" else s
    return c, s


def receiver_for(kind, case):
    return KINDS[kind](spec=WINDOWED, rollback_tokens=2) if case == "windowed" else KINDS[kind]()


def pair(rank: int) -> dict:
    """Every case of every cache kind, direct and packed; then the refusals."""
    out = {}
    gen = torch.Generator().manual_seed(0)
    for kind in KINDS:
        for case in CASES:
            for packed in (False, True):
                key = (kind, case, packed)
                if rank == 0:
                    c, s = build(kind, case, gen)
                    before = state(c)
                    st = send_sequence(c, s, 1, packed=packed, extra={"req": key})
                    out[key] = {"sent": content(c, s), "before": before, "after": state(c),
                                "stats": st, "plan": wire.plan_handoff(c, s, packed)}  # fmt: skip
                    check_invariants(c)
                else:
                    c = receiver_for(kind, case)
                    arrival = recv_sequence(c, 0)
                    check_invariants(c)
                    s = arrival.slot
                    out[key] = {"got": content(c, s), "extra": arrival.extra,
                                "stats": arrival.stats,
                                "pages": c.capacity.mapped_pages(s)}  # fmt: skip
                c.close()
        out[(kind, "refusals")] = refusals(rank, kind, gen)
    return out


def refusals(rank, kind, gen) -> dict:
    """The receiver out of pages, a sender error, a mismatched layout: nothing changes."""
    res = {}
    if rank == 0:
        c, s = build(kind, "plain", gen)
        for name, seq in (("full", s), ("abort", 99), ("mismatch", s)):
            before = state(c)
            try:
                send_sequence(c, seq, 1)
                res[name] = "sent"
            except (CacheFull, TransferError, KeyError) as exc:
                res[name] = type(exc).__name__
            res[name + "_same"] = _same(before, state(c))
        check_invariants(c)
        c.close()
        return res
    c = KINDS[kind]()
    hog = c.new_sequence()  # leaves fewer pages than a 45-token sequence maps
    while c._pool.num_available >= c.capacity.pages_for_tokens(45):
        if not c.can_grow(hog, 8):
            hog = c.new_sequence()
        c.grow(hog, 8)
    for name in ("full", "abort", "mismatch"):
        if name == "mismatch":
            c.close()
            c = KINDS["vm_token_major" if kind == "vm" else "vm"]()
        before = state(c)
        try:
            recv_sequence(c, 0)
            res[name] = "received"
        except (CacheFull, TransferError) as exc:
            res[name] = type(exc).__name__
        res[name + "_same"] = _same(before, state(c))
        check_invariants(c)
    c.close()
    return res


def _same(a, b) -> bool:
    kv_a, kv_b = a["kv"], b["kv"]
    return (a["stats"] == b["stats"] and a["refcounts"] == b["refcounts"]
            and a["seqs"] == b["seqs"] and kv_a.keys() == kv_b.keys()
            and all(torch.equal(x, y) for s in kv_a for x, y in zip(kv_a[s], kv_b[s])))  # fmt: skip


def lost_peer(rank: int, kind: str) -> dict:
    """Three ranks. 0 sends to 1 and dies after its first K/V message: 1 must come out as it
    was. Then 1 receives from 2 and dies after the first message: 2 must be unchanged."""
    gen = torch.Generator().manual_seed(1)
    if rank in (0, 2):
        c, s = build(kind, "plain", gen)
        if rank == 2:
            dist.recv(torch.zeros(1), 1)  # rank 1 is ready for the second act
        before = state(c)
        sends = 0
        real = wire._send

        def dying(tensor, peer, group, deadline):
            nonlocal sends
            if rank == 0 and tensor.dtype == torch.uint8:
                sends += 1
                if sends == 3:  # meta, then one K/V message, then death
                    os._exit(17)
            real(tensor, peer, group, deadline)

        wire._send = dying
        try:
            send_sequence(c, s, 1)
            result = "sent"
        except TransferError:
            result = "TransferError"
        return {"result": result, "same": _same(before, state(c)), "invariants": _ok(c)}
    c = KINDS[kind]()
    keep = c.new_sequence()
    fill(c, keep, 20, gen)
    before = state(c)
    try:
        recv_sequence(c, 0)
        first = "received"
    except TransferError:
        first = "TransferError"
    report = {"first": first, "same": _same(before, state(c)), "invariants": _ok(c)}
    real = wire._recv
    seen = 0

    def dying_recv(tensor, src, group, deadline):
        nonlocal seen
        real(tensor, src, group, deadline)
        seen += tensor.dtype == torch.uint8
        if seen == 3:
            os._exit(18)  # rank 1's report is the file it wrote first

    import pickle

    with open(os.environ["VMCACHE_TEST_REPORT"], "wb") as f:
        pickle.dump(report, f)
    dist.send(torch.zeros(1), 2)
    wire._recv = dying_recv
    recv_sequence(c, 2)
    return report


def _ok(c) -> bool:
    check_invariants(c)
    return True
