"""Which sequences run next step, and who is preempted when memory runs out.

Each step: (1) every running sequence is grown for its next token, oldest first; when the pool
cannot cover one, a victim (``victim="last"``: the most recently admitted, or ``"first"``) is
preempted by ``swap`` (K/V to the host tier, ``swap_in`` later) or ``recompute`` (pages freed,
tokens kept, re-prefilled later). (2) Only if nobody was preempted, swapped sequences come back
and waiting ones are admitted, FIFO, while the pool keeps one page per table for each running
sequence's next token (a watermark, so admission does not force the next preemption).
Growing here, before the model runs, is the step's map phase (timed by the engine).
"""

from __future__ import annotations

from collections import deque

from ..errors import CacheFull
from .request import Seq, Status

POLICIES = ("recompute", "swap")
VICTIMS = ("last", "first")


class Scheduler:
    def __init__(self, kv, preemption: str = "recompute", victim: str = "last",
                 max_batch_tokens: int = 2048) -> None:  # fmt: skip
        if preemption not in POLICIES:
            raise ValueError(f"preemption must be one of {POLICIES}, got {preemption!r}")
        if victim not in VICTIMS:
            raise ValueError(f"victim must be one of {VICTIMS}, got {victim!r}")
        self.kv, self.preemption, self.victim = kv, preemption, victim
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Seq] = deque()  # owned here: FIFO, preempted-by-recompute first
        self.swapped: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.preempt_swap = self.preempt_recompute = 0
        self.swap_bytes = self.recompute_tokens = 0
        self.prefix_hit_tokens = 0  # prompt tokens whose K/V came from the prefix index

    def has_work(self) -> bool:
        return bool(self.waiting or self.swapped or self.running)

    def _room(self, pages: int) -> bool:
        watermark = self.kv.pages_for_tokens(1) * len(self.running)
        return self.kv.pool.can_allocate(pages + watermark)

    def _pick_victim(self, exclude: Seq) -> Seq | None:
        others = [s for s in self.running if s is not exclude]
        if not others:
            return None
        key = lambda s: s.admitted_at
        return max(others, key=key) if self.victim == "last" else min(others, key=key)

    def _preempt(self, seq: Seq, batch: list[Seq]) -> None:
        self.running.remove(seq)
        if seq in batch:  # already grown for this step: give that back first
            batch.remove(seq)
            self.kv.truncate(seq.slot, seq.cached)
        if self.preemption == "swap":
            try:
                seq.swap = self.kv.swap_out(seq.slot)
            except CacheFull:  # host tier full: recompute instead, nothing is lost
                pass
            else:
                seq.slot, seq.status = None, Status.SWAPPED
                self.swapped.append(seq)
                self.preempt_swap += 1
                self.swap_bytes += seq.swap.nbytes
                return
        self.kv.free(seq.slot)
        self.recompute_tokens += seq.cached
        seq.slot, seq.cached, seq.status = None, 0, Status.WAITING
        self.waiting.appendleft(seq)
        self.preempt_recompute += 1

    def _start(self, seq: Seq, step: int, batch: list[Seq]) -> None:
        seq.status, seq.admitted_at = Status.RUNNING, step
        self.running.append(seq)
        self.kv.grow(seq.slot, len(seq.pending), token_ids=seq.pending)
        batch.append(seq)

    def _admit(self, seq: Seq) -> bool:
        """Give a waiting sequence a slot, its cached prefix mapped in (prefix caching on),
        if the rest of its tokens fit; at least its last token is left to compute."""
        kv, n = self.kv, len(seq.tokens)
        slot = kv.new_sequence(prefix_tokens=seq.tokens if kv.prefix else None, salt=seq.req.salt)
        hit = kv.seq_len(slot)
        if hit >= n:
            kv.truncate(slot, n - 1)
            hit = n - 1
        if not self._room(kv.pages_for_tokens(n) - kv.pages_for_tokens(hit)):
            kv.free(slot)
            return False
        seq.slot, seq.cached = slot, hit
        self.prefix_hit_tokens += hit
        return True

    def schedule(self, step: int) -> list[Seq]:
        """The sequences to run this step, each grown to cover its pending tokens."""
        batch: list[Seq] = []
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.admitted_at):
            if seq not in self.running:
                continue  # preempted as a victim earlier in this loop
            n = len(seq.pending)
            while not self.kv.can_grow(seq.slot, n):
                victim = self._pick_victim(exclude=seq)
                if victim is None:
                    raise CacheFull(f"a single sequence cannot grow to {seq.cached + n} tokens "
                                    "in this pool", wanted=n, free=0)  # fmt: skip
                self._preempt(victim, batch)
                preempted = True
            self.kv.grow(seq.slot, n, token_ids=seq.pending)
            batch.append(seq)
        if preempted:
            return batch
        while self.swapped and len(self.kv.sequences) < self.kv.max_seqs:
            seq = self.swapped[0]
            if not self._room(self.kv.pages_for_tokens(seq.swap.length + 1)):
                break
            seq.slot = self.kv.swap_in(seq.swap)
            seq.swap = None
            self.swapped.popleft()
            self._start(seq, step, batch)
        tokens = sum(len(s.pending) for s in batch)
        while self.waiting and len(self.kv.sequences) < self.kv.max_seqs:
            seq = self.waiting[0]
            n = len(seq.pending)
            if tokens + n > self.max_batch_tokens and tokens > 0:
                break
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self._start(seq, step, batch)
            tokens += len(seq.pending)
        return batch
