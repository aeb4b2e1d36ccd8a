"""Sizing mode: replay a trace through one allocator's real bookkeeping, step by step.

Every step, each running request's sequences (1, or n samples, or beam-width beams) gain one
token; a request that cannot grow preempts the most recently admitted one (recompute: its
memory is freed and it is re-prefilled later, prompt + tokens so far). Waiting requests are
admitted FIFO while the allocator accepts them. Beams are reordered every step with a seeded
choice of parents (``assign`` on the caches; a gather copy on static / Orca).

Per-step sums give the figures (ratios of sums over all steps):
    internal waste    = Σ(granule − used) / Σ logical      (partly filled pages / chunks)
    reservation waste = Σ(logical − granule) / Σ logical   (static L_max reservations)
    CoW saving        = Σ(logical − held) / Σ logical      (pages shared by forks / beams)
    stalls            = requests whose admission was refused while the free total would have
                        sufficed (external fragmentation; only contiguous arenas have it)
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from .traces import TraceRequest, token_id


class DoesNotFit(RuntimeError):
    """A request cannot run even with the whole budget to itself."""


@dataclass(eq=False)
class _Group:
    rid: int
    req: TraceRequest
    handles: list[int] = field(default_factory=list)
    generated: int = 0
    admitted_at: int = -1
    length: int = 0  # tokens each of its sequences holds

    @property
    def width(self) -> int:
        return max(self.req.n, self.req.beam)


def simulate(alloc, trace: list[TraceRequest], seed: int = 0, progress=None,
             preemption: str = "recompute") -> dict:  # fmt: skip
    """Replay ``trace``; ``preemption`` is how a victim comes back: ``recompute`` (its tokens
    are prefilled again) or ``swap`` (its K/V go to the host and back: bytes moved, no
    prefill)."""
    if preemption not in ("recompute", "swap"):
        raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
    rng = random.Random(seed)
    waiting: deque[_Group] = deque(_Group(i, r) for i, r in enumerate(trace))
    running: list[_Group] = []
    sums = dict(held=0, logical=0, granule=0, used=0)
    stalled: set[int] = set()
    steps = preemptions = recompute_tokens = swap_bytes = max_seqs = 0
    swapped: set[int] = set()  # requests whose K/V wait on the host
    peak_held = generated = seq_steps = prefill_tokens = 0
    total = len(trace)
    while waiting or running:
        # 1. decode growth for running requests, oldest first; preempt the newest when short
        for g in sorted(running, key=lambda g: g.admitted_at):
            if g not in running:
                continue
            if g.req.beam > 1 and g.generated:
                parents = [h if rng.random() < 0.75 else rng.choice(g.handles)
                           for h in g.handles]  # fmt: skip
                alloc.assign(g.handles, parents)
            for h in g.handles:  # one at a time: a grow can change what the next one finds
                while not alloc.can_grow(h, 1):
                    victim = max((x for x in running if x is not g),
                                 key=lambda x: x.admitted_at, default=None)  # fmt: skip
                    if victim is None:
                        raise DoesNotFit(f"request {g.rid} alone does not fit the budget")
                    for v in victim.handles:
                        alloc.free(v)
                    running.remove(victim)
                    preemptions += 1
                    held = victim.req.prompt_len + victim.generated
                    if preemption == "swap":
                        swap_bytes += held * alloc.bpt * len(victim.handles)  # out
                        swapped.add(victim.rid)
                    else:
                        recompute_tokens += held
                    victim.handles = []
                    waiting.appendleft(victim)
                ids = [token_id(g.req, g.rid, g.length)] if alloc.uses_ids else None
                alloc.grow(h, 1, ids)
            g.length += 1
        # 2. admission, FIFO
        while waiting:
            g = waiting[0]
            tokens = g.req.prompt_len + g.generated
            if not alloc.can_admit(tokens, sum(len(x.handles) for x in running), g.width):
                if alloc.can_fragment and alloc.free_bytes() >= alloc.need_bytes(tokens) * g.width:
                    stalled.add(g.rid)  # free memory sufficed, its shape did not
                if not running:
                    raise DoesNotFit(f"request {g.rid} ({tokens} tokens × {g.width}) does not "
                                     "fit the budget even alone")  # fmt: skip
                break
            waiting.popleft()
            ids = [token_id(g.req, g.rid, p) for p in range(tokens)] if alloc.uses_ids else None
            h = alloc.admit(tokens, ids)
            if g.rid in swapped:  # swapped back in: the same bytes again, nothing computed
                swapped.discard(g.rid)
                swap_bytes += tokens * alloc.bpt * g.width
            else:
                prefill_tokens += tokens - alloc.last_hit
            g.length = tokens
            g.handles = [h] + (alloc.fork(h, g.width - 1) if g.width > 1 else [])
            g.admitted_at = steps
            running.append(g)
        # 3. the step: every running sequence produced one token (prefills produce the first)
        for g in list(running):
            g.generated += 1
            generated += len(g.handles)
            if g.generated >= g.req.output_len:
                for h in g.handles:
                    alloc.free(h)
                running.remove(g)
        snap = alloc.snapshot()
        for k in sums:
            sums[k] += snap[k]
        peak_held = max(peak_held, snap["held"])
        live = sum(len(g.handles) for g in running)
        max_seqs, seq_steps = max(max_seqs, live), seq_steps + live
        steps += 1
        if progress is not None and steps % 50 == 0:
            progress(total - len(waiting) - len(running), total)
    logical = max(sums["logical"], 1)
    return {
        "internal_waste_pct": 100 * (sums["granule"] - sums["used"]) / logical,
        "reservation_waste_pct": 100 * (sums["logical"] - sums["granule"]) / logical,
        "cow_saving_pct": 100 * (sums["logical"] - sums["held"]) / logical,
        "waste_tokens_per_seq": (sums["granule"] - sums["used"]) / alloc.bpt / max(seq_steps, 1),
        "frag_stalls": len(stalled),
        "max_concurrent_seqs": max_seqs,
        "preemptions": preemptions,
        "recompute_tokens": recompute_tokens,
        "swap_bytes": swap_bytes,
        "bytes_copied": alloc.copied_bytes,
        "steps": steps,
        "prefill_tokens": prefill_tokens,  # prompt tokens computed (cached ones excluded)
        "tokens_per_step": generated / max(steps, 1),
        "peak_held_GB": peak_held / 1e9,
    }
