"""Sizing mode: replay a trace through one allocator's real bookkeeping, step by step, in
modelled time (:class:`~vmcache.bench.latency.StepModel`).

Requests arrive at their ``arrival_s`` (open loop). Each step, in this order:
  1. every decoding sequence gains the token it produced last step, oldest request first; a
     sequence that cannot grow preempts the most recently admitted request (``recompute``:
     freed, prefilled again later; ``swap``: its K/V leave and come back, bytes counted);
  2. requests still prefilling take their next chunk of the step's token budget
     (``max_batch_tokens`` minus the decoding sequences: chunked prefill);
  3. if nobody was preempted, waiting requests are admitted FIFO with their first chunk while
     the allocator accepts them, leaving room for the running sequences whose next token needs
     new memory; with prefix caching, a request whose prefix another request is computing
     right now waits for it (it would miss the cache this step and hit it once written);
  4. the clock advances by the step's modelled time; sequences whose prefill completed or who
     decoded produce a token; a finished request frees its memory.

Bookkeeping is O(what changed) per step: a sequence's memory is asked about only when its
allocation changes; in between, its length runs ahead of the allocator's (``synced``), inside
what its pages already hold (``cap``), and is brought up to date before anything reads it.

Per-step sums give the figures (ratios of sums over all steps):
    internal waste    = Σ(granule − used) / Σ logical      (partly filled pages / chunks)
    reservation waste = Σ(logical − granule) / Σ logical   (static L_max reservations)
    CoW saving        = Σ(logical − held) / Σ logical      (pages shared by forks / beams)
    stalls            = requests whose admission was refused while the free total would have
                        sufficed (external fragmentation; only contiguous arenas have it)
and per request the worst waste any of its sequences had at any step (``seq_waste_*``).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from vmcache.bench.latency import StepModel, percentile, summarize
from vmcache.bench.traces import TraceRequest, token_id
from vmcache.errors import CacheFull
from vmcache.prefix.entry import whole_pages_shared


class DoesNotFit(RuntimeError):
    """A request cannot run even with the whole budget to itself."""


@dataclass(eq=False)
class _Group:
    rid: int
    req: TraceRequest
    handles: list[int] = field(default_factory=list)
    synced: list[int] = field(default_factory=list)  # each handle's length in the allocator
    cap: list[int] = field(default_factory=list)  # length each handle reaches without memory
    mapped: list[int] = field(default_factory=list)  # bytes each handle's allocation covers
    generated: int = 0
    length: int = 0  # tokens each of its sequences holds
    target: int = 0  # tokens whose K/V must exist before it decodes (prompt + generated)
    decoding: bool = False
    completes: bool = False  # its prefill ends this step: it produces a token
    admitted_at: int = -1
    first_s: float | None = None
    preempted: bool = False  # its K/V were thrown away once: its prefill is a recompute
    worst_waste: int = 0  # bytes: the most any of its sequences over-allocated, any step

    @property
    def width(self) -> int:
        return max(self.req.n, self.req.beam)

    def ids(self, lo: int, hi: int) -> list[int]:
        return [token_id(self.req, self.rid, p) for p in range(lo, hi)]


class _Sim:
    def __init__(self, alloc, trace, seed, progress, preemption, max_batch_tokens, model):
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption must be 'recompute' or 'swap', got {preemption!r}")
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.alloc, self.progress, self.preemption = alloc, progress, preemption
        self.budget_tokens, self.model = max_batch_tokens, model
        self.rng = random.Random(seed)
        order = sorted(range(len(trace)), key=lambda i: trace[i].arrival_s)
        self.groups = [_Group(i, trace[i]) for i in order]
        self.waiting: deque[_Group] = deque()
        self.running: list[_Group] = []  # admission order: the newest is last
        self.swapped: set[int] = set()
        self.used_tokens = self.mapped_bytes = 0  # running totals over live sequences
        self.n = dict(steps=0, preemptions=0, recompute_tokens=0, swap_bytes=0, max_seqs=0,
                      generated=0, seq_steps=0, prefill_tokens=0, mem_refusals=0,
                      prefix_waits=0, peak_held=0, reprefill_tokens=0)  # fmt: skip
        self.sums = dict(held=0, logical=0, granule=0, used=0)
        self.stalled: set[int] = set()
        self.records: list[tuple[float, float, float, int]] = []
        self.worst: list[int] = []
        self.t = 0.0
        self.growing = 0  # running sequences whose next token needs new memory

    # --- one sequence's allocation ---------------------------------------------------------
    def _refresh(self, g: _Group, i: int) -> None:
        a, h = self.alloc, g.handles[i]
        mapped = a.mapped_bytes(h)
        self.mapped_bytes += mapped - g.mapped[i]
        g.mapped[i] = mapped
        g.synced[i] = g.length
        g.cap[i] = g.length + a.headroom(h)
        if not a.reserves:
            g.worst_waste = max(g.worst_waste, g.mapped[i] - g.length * a.bpt)

    def _add(self, g: _Group, hs: list[int]) -> None:
        for h in hs:
            g.handles.append(h)
            g.synced.append(g.length)
            g.cap.append(g.length)
            g.mapped.append(0)
            self.used_tokens += g.length
            self._refresh(g, len(g.handles) - 1)

    def _sync(self, g: _Group, i: int, grow: bool = True) -> None:
        """Bring handle ``i``'s allocator length up to ``g.length`` (preempting for memory)."""
        need = g.length - g.synced[i]
        if need <= 0:
            return
        h = g.handles[i]
        ids = g.ids(g.synced[i], g.length) if self.alloc.uses_ids else None
        while not self.alloc.try_grow(h, need, ids):
            self._preempt(exclude=g)
        self._refresh(g, i)

    def _drop(self, g: _Group) -> None:
        """Free every sequence of ``g`` (its known token ids first go to the prefix index,
        where that needs no other sequence preempted: a drop that preempted could recurse,
        each victim's sync preempting the next)."""
        for i, h in enumerate(g.handles):
            need = g.length - g.synced[i]
            if (
                self.alloc.uses_ids
                and need > 0
                and self.alloc.try_grow(h, need, g.ids(g.synced[i], g.length))
            ):
                self._refresh(g, i)  # (what _sync does, but never preempting)
            self.alloc.free(h)
            self.mapped_bytes -= g.mapped[i]
            self.used_tokens -= g.length
        g.handles, g.synced, g.cap, g.mapped = [], [], [], []
        self.running.remove(g)

    def _preempt(self, exclude: _Group) -> None:
        victim = next((x for x in reversed(self.running) if x is not exclude), None)
        if victim is None:
            raise DoesNotFit(f"request {exclude.rid} alone does not fit the budget")
        width = len(victim.handles)
        self._drop(victim)
        self.n["preemptions"] += 1
        held = victim.req.prompt_len + victim.generated
        if self.preemption == "swap" and victim.decoding:
            self.n["swap_bytes"] += held * self.alloc.bpt * width  # out
            self.swapped.add(victim.rid)
        else:
            self.n["recompute_tokens"] += victim.length
            victim.preempted = True  # its prefill from now on is work done again
        victim.decoding = victim.completes = False
        self.waiting.appendleft(victim)
        self.preempted = True

    # --- the step ----------------------------------------------------------------------
    def _decode(self) -> int:
        seqs = 0
        self.growing = 0
        for g in list(self.running):
            if not g.decoding or not g.handles:
                continue
            if g.req.beam > 1 and g.generated:
                for i in range(len(g.handles)):
                    self._sync(g, i)
                parents = [h if self.rng.random() < 0.75 else self.rng.choice(g.handles)
                           for h in g.handles]  # fmt: skip
                self.alloc.assign(g.handles, parents)
                for i in range(len(g.handles)):
                    self._refresh(g, i)
            g.length += 1
            self.used_tokens += len(g.handles)
            for i in range(len(g.handles)):
                if g.length > g.cap[i]:
                    self._sync(g, i)
                if g.cap[i] <= g.length:
                    self.growing += 1
            seqs += len(g.handles)
        return seqs

    def _prefill(self, budget: int) -> int:
        done = 0
        for g in list(self.running):
            if g.decoding or g.completes or not g.handles or budget - done <= 0:
                continue
            chunk = min(g.target - g.length, budget - done)
            self.n["reprefill_tokens"] += chunk if g.preempted else 0
            g.length += chunk
            self.used_tokens += chunk
            self._sync(g, 0)
            done += chunk
            g.completes = g.length >= g.target
        return done

    def _in_flight_prefix(self, g: _Group, ids: list[int], hit: int) -> bool:
        """Whether a request still prefilling shares more whole pages with ``ids`` than the
        cache holds now (it will, once that prefill is written)."""
        page = self.alloc.prefix_page_tokens
        for a in self.running:
            if a.decoding or not a.handles:
                continue
            theirs = (token_id(a.req, a.rid, p) for p in range(a.target))
            if whole_pages_shared(theirs, ids, page) > hit:
                return True
        return False

    def _admit(self, budget: int, step: int) -> int:
        alloc, done, i = self.alloc, 0, 0
        while i < len(self.waiting) and budget - done > 0:
            g = self.waiting[i]
            tokens = g.req.prompt_len + g.generated
            back = g.rid in self.swapped  # its K/V come back: nothing to compute
            ids = g.ids(0, tokens) if alloc.uses_ids else None
            hit = min(alloc.cached_tokens(ids), tokens - 1) if ids else 0
            if ids and not back and self._in_flight_prefix(g, ids, hit):
                self.n["prefix_waits"] += 1
                i += 1
                continue
            first = tokens if back else min(tokens - hit, budget - done)
            k = g.width  # its forks (made when the prefill completes) need room too
            h = None
            if alloc.can_admit(first, k, self.growing):
                try:  # a prefix hit pins cached pages that can_admit counted as evictable
                    h = alloc.admit(first, ids)
                except CacheFull:
                    pass
            if h is None:
                self.n["mem_refusals"] += 1
                if alloc.can_fragment and alloc.free_bytes() >= alloc.need_bytes(first):
                    self.stalled.add(g.rid)  # free memory sufficed, its shape did not
                if not self.running:
                    raise DoesNotFit(f"request {g.rid} ({tokens} tokens × {g.width}) does not "
                                     "fit the budget even alone")  # fmt: skip
                break
            del self.waiting[i]
            g.length, g.target, g.admitted_at = alloc.last_hit + first, tokens, step
            self.running.append(g)
            self._add(g, [h])
            if back:
                self.swapped.discard(g.rid)
                self.n["swap_bytes"] += tokens * alloc.bpt * g.width
                self._add(g, alloc.fork(h, g.width - 1) if g.width > 1 else [])
                g.completes = True
            else:
                done += first
                self.n["reprefill_tokens"] += first if g.preempted else 0
                g.completes = g.length >= g.target
            self.growing += sum(1 for c in g.cap if c <= g.length)
        return done

    def _finish_step(self) -> None:
        for g in list(self.running):
            if not (g.decoding or g.completes):
                if g.handles:  # a chunk was written: its full pages can be found now
                    self.alloc.cache_prefix(g.handles[0])
                continue
            if g.completes:
                self.alloc.cache_prefix(g.handles[0])
                if len(g.handles) < g.width:
                    while not self.alloc.can_admit(g.length, g.width - 1, 0):
                        self._preempt(exclude=g)
                    self._add(g, self.alloc.fork(g.handles[0], g.width - len(g.handles)))
                g.decoding, g.completes = True, False
            g.generated += 1
            self.n["generated"] += len(g.handles)
            if g.first_s is None:
                g.first_s = self.t
            if g.generated >= g.req.output_len:
                self._drop(g)
                self.records.append((g.req.arrival_s, g.first_s, self.t, g.req.output_len))
                self.worst.append(g.worst_waste)

    def step(self) -> None:
        n = self.n
        self.preempted = False
        decode_seqs = self._decode()
        budget = max(self.budget_tokens - decode_seqs, 0)
        prefill = self._prefill(budget)
        if not self.preempted:
            prefill += self._admit(budget - prefill, n["steps"])
        n["prefill_tokens"] += prefill
        self.t += self.model.seconds(prefill, decode_seqs, self.used_tokens * self.alloc.bpt)
        self._finish_step()
        used = self.used_tokens * self.alloc.bpt
        held = self.alloc.held_bytes()
        granule = used if self.alloc.reserves else self.mapped_bytes
        for k, v in (("held", held), ("logical", self.mapped_bytes), ("granule", granule),
                     ("used", used)):  # fmt: skip
            self.sums[k] += v
        n["peak_held"] = max(n["peak_held"], held)
        live = sum(len(g.handles) for g in self.running)
        n["max_seqs"], n["seq_steps"] = max(n["max_seqs"], live), n["seq_steps"] + live
        n["steps"] += 1

    def run(self) -> dict:
        total, nxt = len(self.groups), 0
        while nxt < total or self.waiting or self.running:
            while nxt < total and self.groups[nxt].req.arrival_s <= self.t:
                self.waiting.append(self.groups[nxt])
                nxt += 1
            if not self.waiting and not self.running:
                self.t = self.groups[nxt].req.arrival_s
                continue
            self.step()
            if self.progress is not None and self.n["steps"] % 256 == 0:
                self.progress(len(self.records), total)
        return self.result()

    def result(self) -> dict:
        n, sums, bpt = self.n, self.sums, self.alloc.bpt
        logical = max(sums["logical"], 1)
        worst = [w / bpt for w in self.worst]
        binding = n["mem_refusals"] > 0 or n["preemptions"] > 0
        out = {
            "internal_waste_pct": 100 * (sums["granule"] - sums["used"]) / logical,
            "reservation_waste_pct": 100 * (sums["logical"] - sums["granule"]) / logical,
            "cow_saving_pct": 100 * (sums["logical"] - sums["held"]) / logical,
            "waste_tokens_per_seq": (sums["granule"] - sums["used"]) / bpt / max(n["seq_steps"], 1),
            "seq_waste_p50_tok": percentile(worst, 50),
            "seq_waste_p99_tok": percentile(worst, 99),
            "seq_waste_max_tok": max(worst, default=0.0),
            "seq_waste_cdf_tok": [percentile(worst, q) for q in range(0, 101, 5)],
            "frag_stalls": len(self.stalled),
            "max_concurrent_seqs": n["max_seqs"],
            "memory_binding": binding,
            "mem_refusals": n["mem_refusals"],
            "prefix_waits": n["prefix_waits"],
            "preemptions": n["preemptions"],
            "recompute_tokens": n["recompute_tokens"],
            "swap_bytes": n["swap_bytes"],
            "bytes_copied": self.alloc.copied_bytes,
            "steps": n["steps"],
            "prefill_tokens": n["prefill_tokens"],  # prompt tokens computed (cache hits not)
            "reprefill_tokens": n["reprefill_tokens"],  # of those, after a preemption
            "generated_tokens": n["generated"],
            "tokens_per_step": n["generated"] / max(n["steps"], 1),
            "modelled_s": self.t,
            "tokens_per_modelled_s": n["generated"] / self.t if self.t else 0.0,
            "peak_held_GB": n["peak_held"] / 1e9,
        }
        out.update({f"model_{k}": v for k, v in summarize(self.records).items()})
        return out


def simulate(alloc, trace: list[TraceRequest], seed: int = 0, progress=None,
             preemption: str = "recompute", *, max_batch_tokens: int = 8192,
             model: StepModel = StepModel()) -> dict:  # fmt: skip
    """Replay ``trace`` through ``alloc``; returns the figures (see the module doc).
    ``preemption``: how a victim comes back (``recompute``: its tokens are prefilled again;
    ``swap``: its K/V go to the host and back, bytes moved, no prefill)."""
    return _Sim(alloc, trace, seed, progress, preemption, max_batch_tokens, model).run()
