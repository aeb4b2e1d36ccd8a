"""Which sequences run next step, how many tokens each, and who is preempted when memory
runs out.

Each step has a token budget (``max_batch_tokens``). (1) Running sequences are grown for what
they feed this step, oldest first: decodes (one token each) before prompts still being
prefilled, which take what is left of the budget (chunked prefill: a prompt longer than the
budget is fed over several steps, its K/V written chunk by chunk). When the pool cannot cover
a sequence, a victim (``victim="last"``: the most recently admitted, or ``"first"``) is
preempted by ``swap`` (K/V to the host tier, ``swap.restore`` later) or ``recompute`` (pages freed,
tokens kept, re-prefilled later). (2) Only if nobody was preempted, swapped sequences come back
and waiting ones are admitted, FIFO, with their first chunk, while the pool keeps room for the
running sequences whose next token needs a new page (headroom in tokens, not pages per
sequence). With prefix caching, a waiting request whose prefix a running one is prefilling
right now waits a step for it rather than computing it again (``prefix_waits``).
Growing here, before the model runs, is the step's map phase (timed by the engine).

Owned here: the three queues and each sequence's ``slot``, ``cached``, ``status`` and
``admitted_at``. The engine and the disaggregated receiver change them only through
:meth:`Scheduler.add`, ``join``, ``advance``, ``rewind``, ``finish``, ``hand_off`` and
``release`` (tests/project/test_architecture.py parses the package for other writes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from vmcache.engine.request import Seq, Status
from vmcache.errors import CacheFull
from vmcache.prefix.entry import whole_pages_shared

POLICIES = ("recompute", "swap")
VICTIMS = ("last", "first")


@dataclass
class SchedulerStats:
    """What the scheduler counts (into the engine's stats object, which extends this)."""

    preempt_swap: int = 0
    preempt_recompute: int = 0
    swap_bytes: int = 0  # bytes copied to the host tier by swap-outs
    recompute_tokens: int = 0  # tokens whose K/V were dropped and computed again
    prefix_query_tokens: int = 0  # tokens admissions looked up in the prefix index
    prefix_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix index
    prefix_waits: int = 0  # admissions deferred a step to hit a prefix being prefilled


class Scheduler:
    def __init__(self, kv, preemption: str = "recompute", victim: str = "last",
                 max_batch_tokens: int = 2048,
                 stats: SchedulerStats | None = None) -> None:  # fmt: skip
        if preemption not in POLICIES:
            raise ValueError(f"preemption must be one of {POLICIES}, got {preemption!r}")
        if victim not in VICTIMS:
            raise ValueError(f"victim must be one of {VICTIMS}, got {victim!r}")
        self.kv, self.preemption, self.victim = kv, preemption, victim
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Seq] = deque()  # owned here: FIFO, preempted-by-recompute first
        self.swapped: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.stats = stats if stats is not None else SchedulerStats()  # written here only
        self._growing = 0  # running sequences whose next token needs a page (this step)

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    # --- the queues and each sequence's scheduling fields (slot, cached, status, admitted_at)
    # are written here only: the engine and the disaggregated receiver go through these

    def add(self, seq: Seq) -> None:
        """Queue a sequence that holds no slot (a new request, a fork with no slot left)."""
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def join(self, seq: Seq, slot: int, cached: int, admitted_at: int) -> None:
        """``seq`` runs from now in ``slot``, which already holds its first ``cached`` tokens
        (a fork of a prefilled sequence; a sequence handed over by a prefill worker)."""
        seq.slot, seq.cached = slot, cached
        seq.status, seq.admitted_at = Status.RUNNING, admitted_at
        self.running.append(seq)

    def advance(self, seq: Seq) -> None:
        """The model ran ``seq``'s scheduled chunk: its K/V are in the cache."""
        seq.cached += seq.chunk

    def rewind(self, seq: Seq, cached: int) -> None:
        """Drafts verified: the cache holds ``cached`` tokens of ``seq`` (the rest rolled
        back)."""
        seq.cached = cached

    def finish(self, seq: Seq) -> None:
        """Take ``seq`` out of whichever queue holds it, what it holds released (running:
        its pages; swapped: its host copy)."""
        if seq in self.running:
            self.kv.free(seq.slot)
            self.running.remove(seq)
        elif seq in self.swapped:
            self.kv.swap.discard(seq.swap)
            self.swapped.remove(seq)
            seq.swap = None
        else:
            self.waiting.remove(seq)
        seq.slot, seq.status = None, Status.FINISHED

    def hand_off(self, seq: Seq) -> None:
        """``seq`` leaves this scheduler, its pages kept until :meth:`release` (a prefill
        worker sends them to its decode worker first)."""
        self.running.remove(seq)
        seq.status = Status.FINISHED

    def release(self, seq: Seq) -> None:
        """The pages of a handed-off sequence back to the pool."""
        self.kv.free(seq.slot)
        seq.slot = None

    def preempt_one(self) -> bool:
        """Preempt one running sequence now (between steps; the victim policy's pick, by
        swap or recompute): a memory limit lowered below what runs is met this way. False
        when nothing runs."""
        victim = self._pick_victim(exclude=None)
        if victim is None:
            return False
        self._preempt(victim, [])
        return True

    def _room(self, pages: int) -> bool:
        return self.kv.capacity.can_allocate(
            pages + self._growing * self.kv.capacity.pages_for_tokens(1)
        )

    def _pick_victim(self, exclude: Seq) -> Seq | None:
        others = [s for s in self.running if s is not exclude]
        if not others:
            return None
        key = lambda s: s.admitted_at
        return max(others, key=key) if self.victim == "last" else min(others, key=key)

    def _preempt(self, seq: Seq, batch: list[Seq]) -> None:
        self.running.remove(seq)
        seq.drop_draft()  # only verified tokens go to the host tier or are recomputed
        if seq in batch:  # already grown for this step: give that back first
            batch.remove(seq)
            self.kv.beams.truncate(seq.slot, seq.cached)
        if self.preemption == "swap":
            try:
                seq.swap = self.kv.swap.out(seq.slot)
            except CacheFull:  # host tier full: recompute instead, nothing is lost
                pass
            else:
                seq.slot, seq.status = None, Status.SWAPPED
                self.swapped.append(seq)
                self.stats.preempt_swap += 1
                self.stats.swap_bytes += seq.swap.nbytes
                return
        self.kv.free(seq.slot)
        self.stats.recompute_tokens += seq.cached
        seq.slot, seq.cached, seq.status = None, 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.stats.preempt_recompute += 1

    def _allocate(self, seq: Seq, n: int):
        """The cache's one allocation call for ``seq``'s next ``n`` tokens: what it did, or
        None (nothing changed) when the pool is short."""
        return self.kv.allocate(seq.slot, n, token_ids=seq.tokens[seq.cached : seq.cached + n])

    def _lost_race(self, seq: Seq, n: int, batch: list[Seq]) -> None:
        """An admitted grow found the pool short after all: only a shared budget, whose pages
        another process took first, may do that; ``seq`` waits (its pages freed)."""
        if not self.kv.elastic.shared_budget:
            raise CacheFull(f"the pool cannot grow sequence {seq.slot} by {n} tokens it had "
                            "room for", wanted=n, free=0)  # fmt: skip
        self._preempt(seq, batch)

    def _start(self, seq: Seq, step: int, batch: list[Seq], chunk: int) -> bool:
        seq.status, seq.admitted_at, seq.chunk = Status.RUNNING, step, chunk
        self.running.append(seq)
        if self._allocate(seq, chunk) is None:
            self._lost_race(seq, chunk, batch)
            return False
        batch.append(seq)
        if self.kv.capacity.headroom(seq.slot) == 0:
            self._growing += 1
        return True

    def _waits_for_prefix(self, seq: Seq) -> bool:
        """Whether a running sequence still prefilling shares more whole pages with ``seq``
        than the cache holds now: admitted next step instead, ``seq`` finds them cached."""
        kv = self.kv
        if not kv.prefix.enabled or seq.needs_prompt_logprobs:
            return False
        page = kv.prefix.hit_unit
        hit = kv.prefix.cached_tokens(seq.tokens, seq.req.salt)
        for a in self.running:
            if a.req.salt != seq.req.salt or a.generated:
                continue  # decoding: its prompt's pages were indexed after its prefill
            if whole_pages_shared(a.tokens, seq.tokens, page) > hit:
                return True
        return False

    def _admit(self, seq: Seq, budget: int) -> int:
        """Give a waiting sequence a slot, its cached prefix mapped in (prefix caching on),
        if its first chunk (at most ``budget`` tokens) fits; at least its last token is left
        to compute (every token, when its prompt's log-probabilities are still to report).
        Returns the chunk, 0 if it was not admitted."""
        kv, n = self.kv, len(seq.tokens)
        lookup = kv.prefix.enabled and not seq.needs_prompt_logprobs
        slot = kv.new_sequence(prefix_tokens=seq.tokens if lookup else None, salt=seq.req.salt)
        hit = kv.seq_len(slot)
        if hit >= n:
            kv.beams.truncate(slot, n - 1)
            hit = n - 1
        chunk = min(n - hit, budget)
        if not self._room(kv.capacity.grow_pages(slot, chunk)):  # a partial hit: its copy too
            kv.free(slot)
            return 0
        seq.slot, seq.cached = slot, hit
        if seq.prefix_hit is None:  # its first admission (a re-prefill counts in stats only)
            seq.prefix_hit = hit
        self.stats.prefix_query_tokens += n if kv.prefix.index is not None else 0
        self.stats.prefix_hit_tokens += hit
        return chunk

    def schedule(self, step: int) -> list[Seq]:
        """The sequences to run this step, each grown to cover its ``scheduled`` tokens."""
        batch: list[Seq] = []
        preempted = False
        budget = self.max_batch_tokens
        order = sorted(self.running, key=lambda s: (len(s.pending) > 1, s.admitted_at))
        for seq in order:  # decodes first, then prefill chunks; oldest first within each
            if seq not in self.running or budget == 0:
                continue  # preempted as a victim earlier in this loop, or no budget left
            n = min(len(seq.pending), budget)
            while self._allocate(seq, n) is None:
                if self.kv.can_grow(seq.slot, n):  # the pool said yes, then no: a shared
                    self._lost_race(seq, n, batch)  # budget's pages went to another process
                    preempted = True
                    break
                victim = self._pick_victim(exclude=seq)
                if victim is None and self.kv.elastic.shared_budget:
                    victim = seq  # a shared budget: others hold the pages, and will free them
                if victim is None:
                    raise CacheFull(f"a single sequence cannot grow to {seq.cached + n} tokens "
                                    "in this pool", wanted=n, free=0)  # fmt: skip
                self._preempt(victim, batch)
                preempted = True
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            seq.chunk = n
            batch.append(seq)
            budget -= n
        if preempted:
            return batch
        self._growing = sum(1 for s in self.running if self.kv.capacity.headroom(s.slot) == 0)
        while self.swapped and self.kv.capacity.free_slots:
            seq = self.swapped[0]
            if not self._room(
                self.kv.swap.restore_pages(seq.swap) + self.kv.capacity.pages_for_tokens(1)
            ):
                break
            seq.slot = self.kv.swap.restore(seq.swap)
            seq.swap = None
            self.swapped.popleft()
            if not self._start(seq, step, batch, min(len(seq.pending), max(budget, 1))):
                return batch
            budget = max(budget - seq.chunk, 0)
        i = 0
        while i < len(self.waiting) and self.kv.capacity.free_slots and budget > 0:
            seq = self.waiting[i]
            if self._waits_for_prefix(seq):
                self.stats.prefix_waits += 1
                i += 1
                continue
            chunk = self._admit(seq, budget)
            if not chunk:
                break
            del self.waiting[i]
            if not self._start(seq, step, batch, chunk):
                break
            budget -= chunk
        return batch
