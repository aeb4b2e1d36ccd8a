"""The admission arithmetic of a cache (``cache.capacity``): what the pool holds and would
hold, read only, for schedulers and admission control. Nothing here changes a page.

    num_pages, used_pages,    the pool: its size, pages in use (sequences, prefix index,
    available_pages           mapped ahead), pages an allocation could take now
    can_allocate(n)           whether n pages could be allocated now
    pages_for_tokens(n)       pages a new sequence of n tokens maps (every table)
    mapped_pages(s)           pages sequence s maps now (shared ones per sequence)
    grow_pages(s, n)          pages grow(s, n) would allocate now (shared ones it writes:
                              copied first)
    headroom(s)               tokens ``s`` can grow without a new page
    peak_pages(n, step)       the most pages one sequence maps while growing to n tokens
    rollback_margin           tokens a sliding window can still take back (None: no window)
    free_slots                sequence slots free now

Touches, through the core it is handed (:mod:`.core`), only to read: the pool's counts, the
groups' tables and window rules, lengths (``seqs``) and the grow plans of :mod:`.grow`.
"""

from __future__ import annotations

from vmcache.sequences import grow


class Capacity:
    """``cache.capacity``: the admission arithmetic (read only)."""

    def __init__(self, core) -> None:
        self._c = core

    @property
    def num_pages(self) -> int:
        """Pages the pool can ever hold (its size; the budget may allow fewer at a time)."""
        return self._c.pool.num_pages

    @property
    def used_pages(self) -> int:
        """Pages in use: mapped by sequences, held by the prefix index, mapped ahead."""
        return self._c.pool.num_used

    @property
    def available_pages(self) -> int:
        """Pages an allocation could take now (free ones and those the budget may create)."""
        return self._c.pool.num_available

    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` pages could be allocated now (the prefix index's evictable pages
        count as free)."""
        return self._c.pool.can_allocate(n)

    def pages_for_tokens(self, n: int) -> int:
        """Pages a new sequence of ``n`` tokens maps (every table), for admission planning."""
        return self._c.pages_for_tokens(n)

    def grow_pages(self, s: int, n: int) -> int:
        """Pages ``grow(s, n)`` would allocate now: new pages past those mapped ahead, and
        the shared pages it writes into, copied first (a fork's, or a prefix hit's partial
        last page): what an admission must find room for."""
        c = self._c
        s = c.check_seq(s)
        return grow.grow_need(s, grow.group_plans(c, s, n))

    def mapped_pages(self, s: int) -> int:
        """Pages sequence ``s`` maps, every table: its tables' mapped pages (shared ones
        counted per sequence; released ones not) and the pages mapped ahead of it."""
        return grow.mapped_pages(self._c, s)

    @property
    def free_slots(self) -> int:
        """Sequence slots free now (``new_sequence``, ``fork`` and a swap's restore take one)."""
        return self._c.seqs.num_free

    @property
    def rollback_margin(self) -> int | None:
        """Tokens every sliding window can still take back (a rejected draft truncated away
        over them); None without sliding-window layers."""
        return min((g.rollback_tokens for g in self._c.groups if g.sliding), default=None)

    def headroom(self, s: int) -> int:
        """Tokens ``grow(s, n)`` can add without taking a page from the pool: what the
        mapped tail pages still hold, 0 when one is shared (the next grow copies it)."""
        c = self._c
        s = c.check_seq(s)
        length = c.seqs.length(s)
        room = min(g.num_pages(s) * g.P // g.u for g in c.groups) - length
        splits = any(sp for _, sp, _, _ in grow.group_plans(c, s, 1)) if room else False
        return 0 if splits else room

    def peak_pages(self, n: int, step: int) -> int:
        """The most pages (every table) one sequence maps at once while it grows to ``n``
        tokens by at most ``step`` at a time (admission: what must fit in the pool). A
        sliding group holds at most the pages of W − 1 + rollback + step tokens, plus one
        for the page the window starts inside."""
        c = self._c
        total = 0
        for g in c.groups:
            p = g.pages_for(n)
            if g.sliding:
                p = min(p, g.pages_for(g.window - 1 + g.rollback_tokens + step) + 1)
            total += len(g.ids) * p
        return total
