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

from .errors import check_int


class ReserveOps:
    """Mixed into :class:`~vmcache.seqcache.SequenceCache` (its tables, hooks and pool)."""

    def mapped_pages(self, s: int) -> int:
        """Pages sequence ``s`` maps, every table: its tables' pages (shared ones counted
        per sequence; tables grow together) and the pages reserved ahead of it."""
        s = self._check_seq(s)
        return self._T * len(self._tables[s][0]) + sum(len(a) for a in self._ahead[s])

    def headroom(self, s: int) -> int:
        """Tokens ``grow(s, n)`` can add without taking a page from the pool: what the
        mapped tail page still holds, 0 when it is shared (the next grow copies it)."""
        s = self._check_seq(s)
        length = self._lens[s]
        room = len(self._tables[s][0]) * self._P // self._u - length
        splits = self._grow_plan(s, 1)[0] if room else []  # the next grow's copy-on-write
        return 0 if splits else room

    def reserve(self, s: int, n: int) -> int:
        """Map now the pages a later ``grow(s, k ≤ n)`` would map; returns pages mapped."""
        s = self._check_seq(s)
        check_int("n", n)
        if n < 0:
            raise ValueError(f"reserve needs n >= 0, got {n}")
        n = min(n, self.max_seq_len - self._lens[s])
        have = self._ahead[s]
        first = self._pages_for(self._lens[s]) + len(have[0])  # first index not yet mapped
        extra = self._pages_for(self._lens[s] + n) - first
        if extra <= 0 or not self.pool.can_allocate(self._T * extra):
            return 0
        fresh = self.pool.allocate(self._T * extra)
        rows = [fresh[t * extra : (t + 1) * extra] for t in range(self._T)]
        try:
            self._attach_row(s, first, rows)
        except BaseException:
            self.pool.decref(fresh)
            raise
        for t in range(self._T):
            have[t].extend(rows[t])
        self.reserved_pages_mapped += len(fresh)
        return len(fresh)

    def _take_reserved(self, s: int, pages: int) -> int:
        """Move up to ``pages`` reserved pages per table into the tables (grow); returns how
        many per table. They are already mapped at the right indices."""
        have = self._ahead[s]
        take = min(len(have[0]), pages)
        for t in range(self._T):
            self._tables[s][t].extend(have[t][:take])
            del have[t][:take]
        return take

    def _untake_reserved(self, s: int, take: int) -> None:
        for t in range(self._T):
            moved = self._tables[s][t][len(self._tables[s][t]) - take :]
            del self._tables[s][t][len(self._tables[s][t]) - take :]
            self._ahead[s][t][:0] = moved

    def _drop_reserved(self, s: int) -> None:
        """Unmap and release the reserved pages of ``s`` (before anything moves its row)."""
        have = self._ahead[s]
        if not have[0]:
            return
        self._sync()
        first = len(self._tables[s][0])
        for t in range(self._T):
            self._detach(s, t, first, len(have[t]))
        self.pool.decref([p for t in have for p in t])
        for t in have:
            t.clear()
