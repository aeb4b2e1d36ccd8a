"""PagePool: a fixed number of physical pages, a free list and refcounts.

The pool is the only code that changes refcounts. What a page *is* (a CUDA handle, a memfd
offset, a row of a block tensor) belongs to a :class:`PageStore`; the pool asks it to create
pages (lazily, in chunks: ``cuMemCreate`` costs ~200 µs, so pages are created ahead and reused)
and to scrub pages that change owner.

    page id:   0 1 2 3 ... created-1 | created ... num_pages-1
               [ live or on _free    ] [ not created yet: free ]
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from .errors import CacheFull, DriverError, require


class Reclaimer(Protocol):
    """Holds references it can give back on demand (the prefix index's cached pages)."""

    def reclaimable(self) -> int: ...

    def reclaim(self, pages: int) -> int: ...

    def alone_changed(self, page: int, alone: bool) -> None:
        """An indexed page's refcount reached 1 (only the reclaimer holds it) or left 1."""


class PageStore(Protocol):
    def create(self, start: int, count: int) -> None:
        """Make pages ``[start, start+count)`` exist (all or nothing); they read as zeros."""

    def scrub(self, pages: list[int]) -> None:
        """Make ``pages`` read as zeros before a new owner gets them."""


@dataclass(frozen=True)
class PoolStats:
    num_pages: int
    used_pages: int
    free_pages: int
    shared_pages: int  # refcount > 1
    created_pages: int


class PagePool:
    def __init__(
        self,
        num_pages: int,
        store: PageStore,
        *,
        scrub_on_reuse: bool = True,
        chunk_pages: int = 64,
    ) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive int, got {num_pages!r}")
        if chunk_pages <= 0:
            raise ValueError(f"chunk_pages must be positive, got {chunk_pages}")
        self.num_pages = num_pages
        self.scrub_on_reuse = scrub_on_reuse
        self._store = store
        self._chunk = chunk_pages
        self._refcount = [0] * num_pages  # owned here alone
        self._free: list[int] = []  # created pages with refcount 0; pop() gives the lowest id
        self._dirty = [False] * num_pages  # held data since its last scrub
        self._created = 0
        self.reclaimer: Reclaimer | None = None  # asked for pages before CacheFull
        self._indexed = [False] * num_pages  # referenced by the reclaimer (the prefix index)
        self.index_only = 0  # pages the reclaimer alone references (refcount 1, indexed)
        self.num_shared = 0  # pages with refcount > 1 (kept as refcounts change: O(1) stats)

    # --- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + (self.num_pages - self._created)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_available(self) -> int:
        """Free pages plus the ones the reclaimer could evict."""
        extra = self.reclaimer.reclaimable() if self.reclaimer is not None else 0
        return self.num_free + extra

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_available

    def gain_from_decref(self, pages: Iterable[int]) -> int:
        """How many pages :attr:`num_available` would gain if ``pages`` (distinct) each lost
        one reference: those at refcount 1, and indexed ones at 2 (the index alone would
        hold them, so it could evict them). Changes nothing."""
        rc, ix = self._refcount, self._indexed
        return sum(1 for p in pages if rc[p] == 1 or (rc[p] == 2 and ix[p]))

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def used_pages(self) -> list[int]:
        return [p for p in range(self._created) if self._refcount[p] > 0]

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_used, self.num_free, self.num_shared,
                         self._created)  # fmt: skip

    # --- changes -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` pages with refcount 1, all or nothing (:class:`CacheFull` changes nothing)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate needs a non-negative int, got {n!r}")
        if n > self.num_free and self.reclaimer is not None and n <= self.num_available:
            self.reclaimer.reclaim(n - self.num_free)
        if n > self.num_free:
            raise CacheFull(
                f"page pool exhausted: {n} pages wanted, {self.num_free} free of {self.num_pages}",
                wanted=n,
                free=self.num_free,
            )
        while len(self._free) < n:
            self._create_chunk(n - len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        dirty = [p for p in pages if self._dirty[p]]
        if dirty and self.scrub_on_reuse:
            try:
                self._store.scrub(dirty)
            except Exception:
                self._free.extend(reversed(pages))
                raise
        for p in pages:
            self._refcount[p] = 1
            self._dirty[p] = True
        return pages

    def set_indexed(self, pages: Iterable[int], flag: bool) -> None:
        """The reclaimer marks the pages it holds a reference to (keeps ``index_only``)."""
        for p in pages:
            if self._indexed[p] != flag:
                self._indexed[p] = flag
                if self._refcount[p] == 1:
                    self.index_only += 1 if flag else -1
                    self.reclaimer.alone_changed(p, flag)

    def _set_refcount(self, p: int, new: int) -> None:
        old, self._refcount[p] = self._refcount[p], new
        if (old > 1) != (new > 1):
            self.num_shared += 1 if new > 1 else -1
        if self._indexed[p] and (old == 1) != (new == 1):
            self.index_only += 1 if new == 1 else -1
            self.reclaimer.alone_changed(p, new == 1)

    def incref(self, pages: Iterable[int], k: int = 1) -> None:
        pages = list(pages)
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"incref of page {p}, which is not allocated")
        for p in pages:
            self._set_refcount(p, self._refcount[p] + k)

    def decref(self, pages: Iterable[int]) -> list[int]:
        """Drop one reference per entry; returns the pages that went back to the free list."""
        counts: dict[int, int] = {}
        for p in pages:
            counts[p] = counts.get(p, 0) + 1
        rc, indexed = self._refcount, self._indexed
        for p, c in counts.items():
            if rc[p] < c:
                raise ValueError(f"decref of page {p} below zero (refcount {rc[p]})")
        freed = []
        for p, c in counts.items():
            old = rc[p]
            if indexed[p] or old > 1 >= old - c:
                self._set_refcount(p, old - c)  # the shared / index-only counters change
            else:
                rc[p] = old - c  # hot path (frees of whole sequences): no counter moves
            if old == c:
                if indexed[p]:
                    require(False, f"page {p} freed while the index holds it")
                freed.append(p)
        self._free.extend(sorted(freed, reverse=True))
        return freed

    def _create_chunk(self, at_least: int) -> None:
        count = min(max(at_least, self._chunk), self.num_pages - self._created)
        start = self._created
        try:
            self._store.create(start, count)
        except DriverError as exc:
            if "OUT_OF_MEMORY" in exc.code or exc.code in ("ENOMEM", "ENOSPC"):
                raise CacheFull(
                    f"device memory exhausted creating {count} pages ({exc})",
                    wanted=at_least,
                    free=len(self._free),
                ) from exc
            raise
        self._created += count
        self._free[:0] = range(start + count - 1, start - 1, -1)  # below the reused pages
