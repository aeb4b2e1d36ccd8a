"""The elastic side of a cache (``cache.elastic``): how much physical memory it holds, changed
at run time without moving anything a kernel reads, and the page arithmetic a scheduler admits
by.

    trim(keep_free_bytes)     free pages' memory back to the device, down to a low-water mark
    set_limit(bytes)          the most it may hold: lower (free pages go now, mapped ones as
                              their sequences end) or higher (pages created as needed)
    resident_bytes            what it holds now: mapped pages + free pages not yet released
    sleep(keep) / wake()      every page back to the device and again, sequences kept
    headroom(s)               tokens ``s`` can grow without a new page
    peak_pages(n, step)       the most pages one sequence maps while growing to n tokens
    rollback_margin           tokens a sliding window can still take back (None: no window)
    shared_budget             whether other processes share the budget (a stall may pass)
    num_pages, used_pages,    the pool: its size, pages in use (sequences, prefix index,
    available_pages           mapped ahead), pages an allocation could take now
    can_allocate(n)           whether n pages could be allocated now
    pages_for_tokens(n)       pages a new sequence of n tokens maps (every table)
    mapped_pages(s)           pages sequence s maps now (shared ones per sequence)
    grow_pages(s, n)          pages grow(s, n) would allocate now (shared ones it writes:
                              copied first)
    free_slots                sequence slots free now

A cache over a :class:`~vmcache.memory.ledger.SharedBudget` draws pages from a budget several
processes share; ``set_limit`` then does not apply (the ledger's limits do). Pages mapped
ahead (the cache's ``allocate(s, n, ahead=k)``, :mod:`.grow`) are counted here as in use.

Touches, through the core it is handed (:mod:`.core`): the pool (budget, trim, release_all /
recreate), its groups' pages mapped ahead (dropped on a sleep) and window rules, lengths (read),
``sync``, the grow plans of :mod:`.grow` (read: ``grow_pages``, ``headroom``), ``mapped_pages``,
and the cache's sleep hooks (``_release_all``, ``_restore_all``, ``_wake_fill``,
``_device_bytes``); the prefix index only to ``forget`` it on a sleep that keeps nothing.
"""

from __future__ import annotations

from vmcache.errors import check_int
from vmcache.memory.budget import LocalBudget
from vmcache.sequences import grow


class Elastic:
    """``cache.elastic``: trims, limits, sleep and wake, pages mapped ahead, admission
    arithmetic."""

    def __init__(self, core) -> None:
        self._c = core
        self._asleep = None  # (live pages, saved state) while asleep (owned here)

    # --- admission arithmetic (read only) --------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages the pool can ever hold (its size; the budget may allow fewer at a time)."""
        return self._c.pool.num_pages

    @property
    def used_pages(self) -> int:
        """Pages in use: mapped by sequences, held by the prefix index, reserved ahead."""
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
        """Pages ``grow(s, n)`` would allocate now: new pages past those reserved, and the
        shared pages it writes into, copied first (a fork's, or a prefix hit's partial last
        page): what an admission must find room for."""
        c = self._c
        s = c.check_seq(s)
        return grow.grow_need(s, grow.group_plans(c, s, n))

    def mapped_pages(self, s: int) -> int:
        """Pages sequence ``s`` maps, every table: its tables' mapped pages (shared ones
        counted per sequence; released ones not) and the pages reserved ahead of it."""
        return grow.mapped_pages(self._c, s)

    @property
    def free_slots(self) -> int:
        """Sequence slots free now (``new_sequence``, ``fork`` and a swap's restore take one)."""
        return self._c.seqs.num_free

    @property
    def asleep(self) -> bool:
        return self._c.pool.asleep

    @property
    def resident_bytes(self) -> int:
        """Physical memory the cache holds now (0 while asleep)."""
        c = self._c
        return c.pool.num_created * c.config.page_bytes

    @property
    def releases(self) -> bool:
        """Whether trim and sleep give memory back to the device (VMKVCache: pages are
        released; PagedKVCache: its one block tensor stays, except across a sleep)."""
        return self._c.releases_memory

    @property
    def rollback_margin(self) -> int | None:
        """Tokens every sliding window can still take back (a rejected draft truncated away
        over them); None without sliding-window layers."""
        return min((g.rollback_tokens for g in self._c.groups if g.sliding), default=None)

    @property
    def shared_budget(self) -> bool:
        """Whether the cache's memory budget is shared with other processes (memory another
        process frees may let a stalled engine run: it waits instead of failing)."""
        return self._c.pool.shared_budget

    def trim(self, keep_free_bytes: int = 0) -> int:
        """Release the memory of free pages until at most ``keep_free_bytes`` of them stay
        (mapped pages, the prefix index's and reserved ones are not touched; on PagedKVCache
        the blocks are one preallocated tensor and nothing goes back). Returns the bytes
        released (0 for PagedKVCache)."""
        c = self._c
        if check_int("keep_free_bytes", keep_free_bytes) < 0:
            raise ValueError(f"keep_free_bytes must be >= 0, got {keep_free_bytes}")
        n = c.pool.trim(keep_free_bytes // c.config.page_bytes)
        return n * c.config.page_bytes if c.releases_memory else 0

    def set_limit(self, limit_bytes: int) -> None:
        """The most physical memory the cache may hold (whole pages). Lowering it releases
        free pages at once; pages its sequences map stay until they are freed, and no page is
        created while it holds more than the limit (a grow then raises ``CacheFull``, so an
        engine preempts by its policy)."""
        c = self._c
        if not isinstance(c.pool.budget, LocalBudget):
            raise TypeError("this cache draws from a shared budget: its ledger sets the limits")
        if check_int("limit_bytes", limit_bytes) < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        pages = min(limit_bytes // c.config.page_bytes, c.pool.num_pages)
        c.pool.budget.set_limit(pages)
        c.pool.trim(max(0, pages - c.pool.num_used))

    def sleep(self, keep: str = "host") -> int:
        """Give every physical page back, keeping sequences, page tables, the prefix index
        and (VMKVCache) the reservation: ``keep="host"`` first copies the live pages' bytes to
        (pinned) host memory; ``"none"`` drops them (and the prefix index, whose K/V would be
        lost; with prefix tiers its entries are demoted to them first): after :meth:`wake`
        they read as zeros. Until then no call may touch a sequence
        (``RuntimeError``) and no view may be read. Returns the bytes given back.

        VMKVCache: pages are released (``cuMemRelease`` / a punched hole) and :meth:`wake`
        maps new ones at the same virtual addresses, so every view and tensor taken before
        (and a CUDA graph captured on them) reads the same bytes after. PagedKVCache: its
        block tensor's storage is freed and allocated again (same tensor objects, new
        address)."""
        c = self._c
        if keep not in ("host", "none"):
            raise ValueError(f"keep must be 'host' or 'none', got {keep!r}")
        if c.pool.asleep:
            raise RuntimeError("the cache is already asleep")
        for s in c.cache.sequences:
            c.drop_ahead(s)  # pages mapped ahead: nothing to keep
        if keep == "none" and c.cache.prefix.index is not None:
            c.cache.prefix.index.forget()  # cached K/V would read zeros (the tiers keep theirs)
        c.sync()
        live = c.pool.used_pages()
        held = self.resident_bytes if c.releases_memory else c.device_bytes()
        state = c.release_all(live, keep == "host")  # contents saved, nothing mapped
        c.pool.release_all(live)
        self._asleep = (live, state)
        return held

    def wake(self) -> None:
        """Back from :meth:`sleep`: pages created again, contents restored (``keep="host"``),
        every sequence mapped where it was. ``CacheFull`` when the budget or the device
        cannot give the pages back; the cache then stays asleep (call again later)."""
        c = self._c
        if not c.pool.asleep:
            raise RuntimeError("the cache is not asleep")
        live, state = self._asleep
        c.pool.recreate(live, c.wake_fill(live, state))  # bytes back chunk by chunk
        try:
            c.restore_all(live, state)  # contents back, every sequence mapped again
        except BaseException:
            c.pool.release_all(live)
            raise
        self._asleep = None

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
