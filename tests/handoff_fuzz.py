"""What each rank of tests/distributed/test_transfer_fuzz.py runs: rank 0 is a hostile peer that
sends random and mutated hand-off messages at every step of the protocol; rank 1 receives with
:func:`recv_sequence` under a short deadline and reports, per trial, what happened and whether
its cache is as it was (another sequence's K/V, pages, slots, invariants).

Both ranks draw the same trials from one seed. Each trial runs in a fresh process group (a
deadline closes gloo's connection; leftovers of a broken trial never reach the next one). The
hostile peer never sends a message *longer* than the receive the receiver posts: gloo ends the
receiving process on that (see vmcache/distributed/handoff.py); shorter ones, any content, any
header, any order of stopping are fair."""

import random
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from handoff_scenarios import KINDS, _same, build, fill, state

from vmcache import CacheFull
from vmcache.distributed import TransferError, recv_sequence, send_sequence, wire
from vmcache.distributed import handoff as T
from vmcache.memory.budget import LocalBudget
from vmcache.sequences.invariants import check_invariants

DEADLINE_S = 1.0  # the receiver's
HOSTILE_WAIT_S = 0.3  # how long the hostile peer waits on its own messages
STEPS = ["header random", "header field", "abort note", "meta flip", "meta resize",
         "meta field", "data short", "data garbage", "data truncated"]  # fmt: skip


def _h(op, t, g):
    """One message of the hostile peer, waited on briefly; False when it did not go through."""
    try:
        op(t, 1, g).wait(timeout=timedelta(seconds=HOSTILE_WAIT_S))
        return True
    except RuntimeError:
        return False


def _h_send(t, g):
    return _h(dist.isend, t, g)


def _h_recv(t, g):
    return _h(dist.irecv, t, g)


def _valid(c, s, extra):
    m = c.handoff.manifest(s)
    runs = T._buffers(c.handoff.runs(s), False)
    meta = wire.encode_meta(m.firsts, m.token_ids, m.salt, extra)
    header = [T.MAGIC, T.VERSION, T.OK, m.length, len(runs), sum(r.numel() for r in runs),
              len(meta), T.layout_key(c)]  # fmt: skip
    return header, meta, runs


def _meta_field(rng, c, s):
    """A meta with one field made hostile (the header's byte count kept consistent)."""
    m = c.handoff.manifest(s)
    firsts, ids, salt = list(m.firsts), m.token_ids, m.salt
    what = rng.choice(["first", "ids", "salt tag", "salt len", "extra json", "extra deep",
                       "extra nan", "extra long", "groups"])  # fmt: skip
    if what == "first":
        firsts[0] = rng.choice([1, 2, 2**63 - 1, 2**64 - 1, m.length])
        return wire.encode_meta(firsts, ids, salt, None), what
    base = wire.encode_meta(firsts, ids, salt, None)
    ids_end = 4 + 8 * len(firsts) + 1 + (8 * m.length if ids is not None else 0)
    if what == "ids":
        raw = bytearray(base)
        raw[ids_end - 8 : ids_end] = struct.pack("<q", rng.choice([-1, -(2**63)]))
        return bytes(raw), what
    head = base[:ids_end]
    if what == "salt tag":
        return head + bytes([rng.choice([4, 9, 255])]) + struct.pack("<I", 1) + b"x" + \
            struct.pack("<I", 4) + b"null", what  # fmt: skip
    if what == "salt len":
        return head + b"\x01" + struct.pack("<I", rng.choice([2**31, 4097, 2**32 - 1])), what
    salt_part = b"\x00" + struct.pack("<I", 0)
    body = (
        {
            "extra json": b"{not json",
            "extra deep": b"[" * 200000 + b"]" * 200000,
            "extra nan": b"NaN",
            "extra long": b"0" * 8,
        }[what]
        if what != "groups"
        else b""
    )
    if what == "groups":
        return struct.pack("<I", rng.choice([0, 2, 2**32 - 1])) + base[4:], what
    n = len(body) if what != "extra long" else (1 << 20) + 1
    return head + salt_part + struct.pack("<I", n) + body, what


def _sized(meta: bytes, n: int) -> bytes:
    """``meta`` cut or zero-padded to the ``n`` bytes the header announces (what the
    receiver posts, if it reads the meta at all)."""
    return meta[:n] + bytes(max(0, n - len(meta)))


def hostile(g, c, s, rng, step):
    header, meta, runs = _valid(c, s, {"req": [1, 2]})
    if step == "header random":
        vals = [rng.randrange(-(2**63), 2**63) for _ in range(rng.choice([1, 4, 8]))]
        if rng.random() < 0.5 and len(vals) == 8:
            vals[:3] = [T.MAGIC, T.VERSION, rng.choice([T.OK, T.ABORT, 7])]
            vals[6] = rng.choice([vals[6], 0, 1, 64, 4096])
        if _h_send(torch.tensor(vals), g) and len(vals) == 8 and 1 <= vals[6] <= 4096:
            _h_send(torch.randint(0, 256, (vals[6],), dtype=torch.uint8), g)
        return
    if step == "header field":
        j = rng.choice([2, 3, 4, 5, 6, 7])
        header[j] = rng.choice([-1, 0, 2**31, 2**40, 2**62, header[j] + 1, header[j] - 1])
        if not _h_send(torch.tensor(header), g):
            return
        if not 1 <= header[6] <= 1 << 20 or not _h_send(_bytes(_sized(meta, header[6])), g):
            return
    elif step == "abort note":
        n = rng.choice([0, 1, 100, wire.MAX_NOTE_BYTES, wire.MAX_NOTE_BYTES + 1, 2**40])
        _h_send(torch.tensor([T.MAGIC, T.VERSION, T.ABORT, 0, 0, 0, n, 0]), g)
        if 1 <= n <= wire.MAX_NOTE_BYTES:
            _h_send(torch.randint(0, 256, (n,), dtype=torch.uint8), g)
        return
    else:
        if step == "meta flip":
            raw = bytearray(meta)
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
            meta = bytes(raw)
        elif step == "meta resize":
            cut = rng.randrange(len(meta))
            meta = meta[:cut] if rng.random() < 0.5 else meta + bytes(rng.randint(1, 64))
        elif step == "meta field":
            meta, _ = _meta_field(rng, c, s)
        header[6] = len(meta)
        if rng.random() < 0.2 and step.startswith("meta"):
            meta = meta[: rng.randrange(len(meta))]  # shorter than announced: zeros follow
        if not (_h_send(torch.tensor(header), g) and _h_send(_bytes(meta or b"\0"), g)):
            return
    reply = torch.full((2,), -1, dtype=torch.int64)
    if not _h_recv(reply, g) or reply[0] != T.ACCEPTED:
        return
    stall = step == "data short" and rng.random() < 0.5
    if step == "data short":
        runs = runs[: rng.randrange(len(runs))]
    elif step == "data garbage":
        runs = [torch.randint(0, 256, r.shape, dtype=torch.uint8) for r in runs]
    elif step == "data truncated":
        k = rng.randrange(len(runs))
        runs[k] = runs[k][: rng.randrange(runs[k].numel())].clone()
    for r in runs:
        if not _h_send(r, g):
            return
    if stall:  # alive and silent, the connection open: the receiver's deadline must end it
        time.sleep(DEADLINE_S + 0.5)
        return
    _h_recv(torch.ones(1, dtype=torch.int64), g)


def _bytes(b: bytes):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def fuzz(rank: int, trials: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    caches = {}
    for kind in ("vm", "paged"):
        if rank == 0:
            caches[kind] = build(kind, "plain", gen)
        else:
            c = KINDS[kind]()
            victim = c.new_sequence(salt="victim")
            fill(c, victim, 30, gen)
            caches[kind] = (c, victim)
    report, keep = [], []
    for i in range(trials):
        rng = random.Random(seed * 100003 + i)
        kind, step = rng.choice(["vm", "paged"]), rng.choice(STEPS)
        g = dist.new_group([0, 1])
        keep.append(g)  # never torn down mid-trial (a broken trial's ops may be pending)
        c, s = caches[kind]
        if rank == 0:
            hostile(g, c, s, rng, step)
        else:
            before = state(c)
            t0 = time.monotonic()
            try:
                arrival = recv_sequence(c, 0, g, timeout_s=DEADLINE_S)
                outcome, why = "arrived", ""
                check_invariants(c)
                c.free(arrival.slot)
            except (TransferError, CacheFull) as exc:
                outcome, why = type(exc).__name__, str(exc)[:160]
            took = time.monotonic() - t0
            check_invariants(c)
            after = state(c)
            if outcome == "arrived":  # cumulative counters moved; nothing else may have
                after["stats"] = before["stats"]
            report.append({"kind": kind, "step": step, "outcome": outcome, "why": why,
                           "seconds": took, "same": _same(before, after)})  # fmt: skip
        dist.barrier()
    report.append(_commit_lost(rank, *caches["vm"]))
    report.append(_full_after_accept(rank, *caches["vm"]))
    for c, _ in caches.values():
        c.close()
    return report


def _commit_lost(rank, c, s):
    """Every K/V byte arrived, then the commit cannot reach the sender (it died): the
    receiver frees the sequence (the sender keeps its copy) and raises, so the caller never
    holds a slot it was not told of."""
    g = dist.new_group([0, 1])
    if rank == 0:
        header, meta, runs = _valid(c, s, None)
        _h_send(torch.tensor(header), g) and _h_send(_bytes(meta), g)
        _h_recv(torch.zeros(2, dtype=torch.int64), g)
        for r in runs:
            _h_send(r, g)
        dist.barrier()
        return None
    real = T._send

    def lost(tensor, peer, group, deadline):
        if tensor.dtype == torch.int64 and tensor.numel() == 1:  # the commit
            raise TransferError("hand-off with rank 0 failed (send, peer lost)")
        real(tensor, peer, group, deadline)

    before = state(c)
    T._send = lost
    try:
        recv_sequence(c, 0, g, timeout_s=DEADLINE_S)
        outcome = "arrived"
    except TransferError as exc:
        outcome = type(exc).__name__
    finally:
        T._send = real
    check_invariants(c)
    dist.barrier()
    return {"kind": "vm", "step": "commit lost", "outcome": outcome, "why": "commit",
            "seconds": 0.0, "same": _same(before, state(c))}  # fmt: skip


class _Racing(LocalBudget):
    """A budget that says it has room and then refuses the next acquire: what a shared budget
    does when another process takes the pages between ``can_adopt`` and the mapping."""

    armed = False

    def acquire(self, n: int) -> bool:
        if self.armed:
            self.armed = False
            return False
        return super().acquire(n)


def _full_after_accept(rank, c, s):
    """The receiver runs out after its checks said yes: the sender hears CacheFull at once
    (a reply, not a silence it waits out), and the receiver is as it was."""
    g = dist.new_group([0, 1])
    if rank == 0:
        t0 = time.monotonic()
        try:
            send_sequence(c, s, 1, g, timeout_s=30)
            outcome = "sent"
        except (CacheFull, TransferError) as exc:
            outcome = type(exc).__name__
        dist.barrier()
        return {"sender": outcome, "seconds": time.monotonic() - t0}
    budget = _Racing(1 << 20)
    r = KINDS["vm"](budget=budget)
    before = state(r)
    budget.armed = True
    try:
        recv_sequence(r, 0, g, timeout_s=30)
        outcome = "arrived"
    except (CacheFull, TransferError) as exc:
        outcome = type(exc).__name__
    check_invariants(r)
    same = _same(before, state(r))
    r.close()
    dist.barrier()
    return {"kind": "vm", "step": "full after accept", "outcome": outcome, "why": "race",
            "seconds": 0.0, "same": same}  # fmt: skip
