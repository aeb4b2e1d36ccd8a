"""Pages mapped ahead of the grow that needs them (vAttention maps the next step's pages in a
background thread while the current step computes; the engine calls :meth:`reserve` after
launching a step and before waiting for its logits).

Reserved pages sit in the sequence's row right after its last page, mapped and holding a pool
reference, but outside the page table, so every table still covers exactly its length:

    table:    | p0 | p1 | p2 (tail) |            length → p2
    reserved:                        | r0 |       mapped at index 3, taken by the next grow

``grow`` takes them first; ``free``, ``assign``, ``truncate`` and ``swap_out`` give them back
first. Reserving is best effort: with no free page it maps nothing and raises nothing.
"""

from __future__ import annotations

from .errors import CacheFull, check_int


class ReserveOps:
    """What a grow would need (``can_grow``, ``headroom``) and pages mapped ahead of it:
    operations of :class:`~vmcache.seqcache.SequenceCache`; the reserved pages themselves
    belong to each :class:`~vmcache.tables.PageTables` group."""

    def can_grow(self, s: int, n: int) -> bool:
        """Whether ``grow(s, n)`` would succeed now (for schedulers; raises nothing for n)."""
        s = self._check_seq(s)
        if not isinstance(n, int) or n < 0 or self._lens[s] + n > self.max_seq_len:
            return False
        plans, releases = self._grow_plan(s, n), self._release_plans(s)
        back = [p for _, _, pages in releases for p in pages]
        gain = self.pool.gain_from_decref(back) if back else 0
        return self._grow_need(s, plans) <= self.pool.num_available + gain

    def _grow_need(self, s: int, plans) -> int:
        """Pages a grow with these ``plans`` (:meth:`_grow_plan`) allocates: shared tail pages
        to copy and new pages not already reserved, every table."""
        return sum(len(splits) + len(g.ids) * (p_new - p_old - min(len(g.reserved(s)[0]),
                                                                    p_new - p_old))
                   for g, splits, p_old, p_new in plans)  # fmt: skip

    def peak_pages(self, n: int, step: int) -> int:
        """The most pages (every table) one sequence maps at once while it grows to ``n``
        tokens by at most ``step`` at a time (admission: what must fit in the pool). A
        sliding group holds at most the pages of W − 1 + rollback + step tokens, plus one
        for the page the window starts inside."""
        total = 0
        for g in self.groups:
            p = g.pages_for(n)
            if g.sliding:
                p = min(p, g.pages_for(g.window - 1 + g.rollback_tokens + step) + 1)
            total += len(g.ids) * p
        return total

    def mapped_pages(self, s: int) -> int:
        """Pages sequence ``s`` maps, every table: its tables' mapped pages (shared ones
        counted per sequence; released ones not) and the pages reserved ahead of it."""
        s = self._check_seq(s)
        return sum(len(g.ids) * (g.num_pages(s) - g.first(s)) + sum(map(len, g.reserved(s)))
                   for g in self.groups)  # fmt: skip

    def headroom(self, s: int) -> int:
        """Tokens ``grow(s, n)`` can add without taking a page from the pool: what the
        mapped tail pages still hold, 0 when one is shared (the next grow copies it)."""
        s = self._check_seq(s)
        length = self._lens[s]
        room = min(g.num_pages(s) * g.P // g.u for g in self.groups) - length
        splits = any(sp for _, sp, _, _ in self._grow_plan(s, 1)) if room else False
        return 0 if splits else room

    def reserve(self, s: int, n: int) -> int:
        """Map now the pages a later ``grow(s, k ≤ n)`` would map; returns pages mapped."""
        s = self._check_seq(s)
        check_int("n", n)
        if n < 0:
            raise ValueError(f"reserve needs n >= 0, got {n}")
        n = min(n, self.max_seq_len - self._lens[s])
        plan = []  # (group, first index not yet mapped, pages per table)
        for g in self.groups:
            first = g.num_pages(s) + len(g.reserved(s)[0])
            extra = g.pages_for(self._lens[s] + n) - first
            if extra > 0:
                plan.append((g, first, extra))
        total = sum(len(g.ids) * extra for g, _, extra in plan)
        if not plan or not self.pool.can_allocate(total):
            return 0
        try:
            fresh = iter(self.pool.allocate(total))
        except CacheFull:  # a shared budget's pages went to another process first
            return 0
        rows = [[[next(fresh) for _ in range(extra)] for _ in g.ids] for g, _, extra in plan]
        done = []
        try:
            for (g, first, _), r in zip(plan, rows):
                self._attach_row(s, g.ids, first, r)
                done.append((g, first, r))
        except BaseException:
            for g, first, r in done:
                for t, pages in zip(g.ids, r):
                    self._detach(s, t, first, len(pages))
            self.pool.decref([p for r in rows for row in r for p in row])
            raise
        for (g, _, _), r in zip(plan, rows):
            g.add_reserved(s, r)
        self.reserved_pages_mapped += total
        return total

    def _drop_reserved(self, s: int) -> None:
        """Unmap and release the reserved pages of ``s`` (before anything moves its row)."""
        if not any(g.reserved(s)[0] for g in self.groups):
            return
        self._sync()
        for g in self.groups:
            first = g.num_pages(s)
            for t, have in zip(g.ids, g.reserved(s)):
                if have:
                    self._detach(s, t, first, len(have))
            self.pool.decref(g.clear_reserved(s))
