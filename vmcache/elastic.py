"""Elastic memory: how much physical memory a cache holds, changed at run time without
moving anything a kernel reads (operations of :class:`~vmcache.seqcache.SequenceCache`;
pages and the budget belong to the pool).

    trim(keep_free_bytes)     free pages' memory back to the device, down to a low-water mark
    set_memory_limit(bytes)   the most it may hold: lower (free pages go now, mapped ones as
                              their sequences end) or higher (pages created as needed)
    resident_bytes            what it holds now: mapped pages + free pages not yet released
    sleep(keep) / wake()      every page back to the device and again, sequences kept

A cache over a :class:`~vmcache.ledger.SharedBudget` draws pages from a budget several
processes share; ``set_memory_limit`` then does not apply (the ledger's limits do).
"""

from __future__ import annotations

from .budget import LocalBudget
from .errors import check_int


class ElasticOps:
    def trim(self, keep_free_bytes: int = 0) -> int:
        """Release the memory of free pages until at most ``keep_free_bytes`` of them stay
        (mapped pages, the prefix index's and reserved ones are not touched; on PagedKVCache
        the blocks are one preallocated tensor and nothing goes back). Returns the bytes
        released (0 for PagedKVCache)."""
        if check_int("keep_free_bytes", keep_free_bytes) < 0:
            raise ValueError(f"keep_free_bytes must be >= 0, got {keep_free_bytes}")
        n = self.pool.trim(keep_free_bytes // self.page_bytes)
        return n * self.page_bytes if self.releases_memory else 0

    def set_memory_limit(self, limit_bytes: int) -> None:
        """The most physical memory the cache may hold (whole pages). Lowering it releases
        free pages at once; pages its sequences map stay until they are freed, and no page is
        created while it holds more than the limit (a grow then raises ``CacheFull``, so an
        engine preempts by its policy)."""
        if not isinstance(self.pool.budget, LocalBudget):
            raise TypeError("this cache draws from a shared budget: its ledger sets the limits")
        if check_int("limit_bytes", limit_bytes) < 0:
            raise ValueError(f"limit_bytes must be >= 0, got {limit_bytes}")
        pages = min(limit_bytes // self.page_bytes, self.pool.num_pages)
        self.pool.budget.set_limit(pages)
        self.pool.trim(max(0, pages - self.pool.num_used))

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
        if keep not in ("host", "none"):
            raise ValueError(f"keep must be 'host' or 'none', got {keep!r}")
        if self.pool.asleep:
            raise RuntimeError("the cache is already asleep")
        for s in self.sequences:
            self._drop_reserved(s)  # pages mapped ahead: nothing to keep
        if keep == "none" and self.prefix is not None:
            self.prefix.forget()  # cached K/V would read zeros: never serve them (tiers keep them)
        self._sync()
        live = self.pool.used_pages()
        held = self.resident_bytes if self.releases_memory else self._device_bytes()
        state = self._release_all(live, keep == "host")  # contents saved, nothing mapped
        self.pool.release_all(live)
        self._asleep = (live, state)
        return held

    def wake(self) -> None:
        """Back from :meth:`sleep`: pages created again, contents restored (``keep="host"``),
        every sequence mapped where it was. ``CacheFull`` when the budget or the device
        cannot give the pages back; the cache then stays asleep (call again later)."""
        if not self.pool.asleep:
            raise RuntimeError("the cache is not asleep")
        live, state = self._asleep
        self.pool.recreate(live, self._wake_fill(live, state))  # bytes back chunk by chunk
        try:
            self._restore_all(live, state)  # contents back, every sequence mapped again
        except BaseException:
            self.pool.release_all(live)
            raise
        self._asleep = None

    def _wake_fill(self, live: list[int], state):
        """A cache that restores pages' bytes as the pool creates them returns the fill
        (:meth:`VMKVCache._wake_fill`); None: its ``_restore_all`` restores them."""
        return None

    @property
    def asleep(self) -> bool:
        return self.pool.asleep

    @property
    def resident_bytes(self) -> int:
        """Physical memory the cache holds now (0 while asleep)."""
        return self.pool.num_created * self.page_bytes
