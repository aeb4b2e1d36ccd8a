"""The elastic memory of a cache (``cache.elastic``): how much physical memory it holds, changed
at run time without moving anything a kernel reads (the admission arithmetic is
``cache.capacity``, :mod:`.capacity`).

    trim(keep_free_bytes)     free pages' memory back to the device, down to a low-water mark
    set_limit(bytes)          the most it may hold: lower (free pages go now, mapped ones as
                              their sequences end) or higher (pages created as needed)
    resident_bytes            what it holds now: mapped pages + free pages not yet released
    sleep(keep) / wake()      every page back to the device and again, sequences kept
    asleep, releases          whether it sleeps now; whether trim and sleep give memory back
    shared_budget             whether other processes share the budget (a stall may pass)

A cache over a :class:`~vmcache.memory.ledger.SharedBudget` draws pages from a budget several
processes share; ``set_limit`` then does not apply (the ledger's limits do). Pages mapped
ahead (the cache's ``allocate(s, n, ahead=k)``, :mod:`.grow`) are dropped by a sleep.

Touches, through the core it is handed (:mod:`.core`): the pool (budget, trim, release_all /
recreate), the pages mapped ahead (``tx.drop_ahead``), ``sync``, and the cache's sleep hooks
(``release_all``, ``restore_all``, ``wake_fill``, ``device_bytes``); the prefix index only to
``forget`` it on a sleep that keeps nothing.
"""

from __future__ import annotations

from vmcache.errors import check_int
from vmcache.memory.budget import LocalBudget


class Elastic:
    """``cache.elastic``: trims, limits, sleep and wake."""

    def __init__(self, core) -> None:
        self._c = core
        self._asleep = None  # (live pages, saved state) while asleep (owned here)

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
            c.tx.drop_ahead(s)  # pages mapped ahead: nothing to keep
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
