"""PagePool: page ids, a free list and refcounts; physical memory behind ids on demand.

The pool is the only code that changes refcounts. What a page *is* (a CUDA handle, a memfd
offset, a row of a block tensor) belongs to a :class:`PageStore`; the pool asks it to create
pages (lazily, in chunks: ``cuMemCreate`` costs ~200 µs, so pages are created ahead and reused),
to scrub pages that change owner and to release free ones (:meth:`PagePool.trim`). A
:class:`~vmcache.memory.budget.Budget` says how many may exist at once (shrink and grow at run time;
shared by processes with :class:`~vmcache.memory.ledger.SharedBudget`).

    page id:   0 1 2 3 ...                                          num_pages-1
               [ live (refcount > 0) | free, created (_free) | not created (_uncreated) ]
    num_free = created free pages + the uncreated ones the budget lets it create

A page id is stable for its whole life (VMPageStore maps id p at window + p·P), so releasing
its memory and creating it again later changes no page table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from vmcache.errors import CacheFull, DriverError, require
from vmcache.memory.budget import Budget, LocalBudget


class Reclaimer(Protocol):
    """Holds references it can give back on demand (the prefix index's cached pages)."""

    def reclaimable(self) -> int: ...

    def reclaim(self, pages: int) -> int: ...

    def alone_changed(self, page: int, alone: bool) -> None:
        """An indexed page's refcount reached 1 (only the reclaimer holds it) or left 1."""


class PageStore(Protocol):
    def create(self, pages: list[int]) -> None:
        """Make ``pages`` (ids, ascending) exist (all or nothing); they read as zeros."""

    def scrub(self, pages: list[int]) -> None:
        """Make ``pages`` read as zeros before a new owner gets them."""

    def release(self, pages: list[int]) -> None:
        """Give the memory of ``pages`` (created, unreferenced) back to the device."""


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
        budget: Budget | None = None,
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
        self._created = 0  # pages with memory behind them
        self._uncreated = list(range(num_pages - 1, -1, -1))  # ids without; pop() = lowest
        self.budget: Budget = budget if budget is not None else LocalBudget(num_pages)
        self.asleep = False  # set by the cache's sleep(): nothing may be allocated
        self.reclaimer: Reclaimer | None = None  # asked for pages before CacheFull
        self._indexed = [False] * num_pages  # referenced by the reclaimer (the prefix index)
        self.index_only = 0  # pages the reclaimer alone references (refcount 1, indexed)
        self.num_shared = 0  # pages with refcount > 1 (kept as refcounts change: O(1) stats)

    # --- queries -----------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + min(len(self._uncreated), self.budget.available())

    @property
    def shared_budget(self) -> bool:
        """Whether the budget is shared with other processes (it hears unmet demand, and a
        page it said was available may be taken by another process first)."""
        return getattr(self.budget, "want", None) is not None

    @property
    def num_created(self) -> int:
        """Pages with physical memory behind them (in use or free)."""
        return self._created

    @property
    def num_used(self) -> int:
        """Pages with a reference (neither free nor without memory)."""
        return self.num_pages - len(self._free) - len(self._uncreated)

    @property
    def num_available(self) -> int:
        """Free pages plus the ones the reclaimer could evict."""
        extra = self.reclaimer.reclaimable() if self.reclaimer is not None else 0
        return self.num_free + extra

    def can_allocate(self, n: int) -> bool:
        ok = 0 <= n <= self.num_available
        if not ok and n <= self.num_pages and self.shared_budget:
            self.budget.want()  # the other processes hear the demand
        return ok

    def shortage(self, n: int) -> str:
        """Why ``n`` pages cannot be taken now: ``CacheFull``'s message."""
        capped = self.budget.available() < len(self._uncreated)
        why = f" (the memory budget allows {self._created + self.budget.available()})"
        return (f"page pool exhausted: {n} pages wanted, {self.num_free} free of "
                f"{self.num_pages}{why if capped else ''}")  # fmt: skip

    def gain_from_decref(self, pages: Iterable[int]) -> int:
        """How many pages :attr:`num_available` would gain if ``pages`` (distinct) each lost
        one reference: those at refcount 1, and indexed ones at 2 (the index alone would
        hold them, so it could evict them). Changes nothing."""
        rc, ix = self._refcount, self._indexed
        return sum(1 for p in pages if rc[p] == 1 or (rc[p] == 2 and ix[p]))

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    @property
    def refcounts(self) -> Sequence[int]:
        """Every page's refcount, indexed by page: the pool's own list, to read in a loop over
        many pages (a grow checks each table's tail) and never to write."""
        return self._refcount

    def used_pages(self) -> list[int]:
        return [p for p in range(self.num_pages) if self._refcount[p] > 0]

    def stats(self) -> PoolStats:
        return PoolStats(self.num_pages, self.num_used, self.num_free, self.num_shared,
                         self._created)  # fmt: skip

    # --- changes -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """``n`` pages with refcount 1, all or nothing (:class:`CacheFull` changes nothing)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate needs a non-negative int, got {n!r}")
        if self.asleep:
            raise RuntimeError("the cache is asleep: wake() it before allocating pages")
        if n > self.num_free and self.reclaimer is not None and n <= self.num_available:
            self.reclaimer.reclaim(n - self.num_free)
        if n > self.num_free:
            raise CacheFull(self.shortage(n), wanted=n, free=self.num_free)
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
        if freed:
            self._hold_limit()
        return freed

    def _hold_limit(self) -> None:
        """Release free pages while the pool holds more than its budget's limit (a limit
        lowered below what was mapped holds once those pages are freed: they never go back
        to the free list for the next allocation)."""
        over = min(self.budget.excess(), len(self._free))
        if over > 0:
            self.trim(len(self._free) - over)

    def _create_chunk(self, at_least: int) -> None:
        """Create at least ``at_least`` pages (a chunk if the budget allows), lowest ids first."""
        room = min(len(self._uncreated), self.budget.available())
        count = min(max(at_least, self._chunk), room)
        if count < at_least or not self.budget.acquire(count):
            raise CacheFull(f"memory budget: {at_least} more pages wanted, {room} allowed",
                            wanted=at_least, free=len(self._free))  # fmt: skip
        pages = [self._uncreated.pop() for _ in range(count)]
        try:
            self._store.create(sorted(pages))
        except BaseException as exc:
            self._uncreated.extend(reversed(pages))
            self.budget.release(count)
            _raise_full_if_oom(exc, f"creating {count} pages", at_least, len(self._free))
            raise
        self._created += count
        self._free[:0] = sorted(pages, reverse=True)  # below the reused pages

    def trim(self, keep_free: int = 0) -> int:
        """Release the memory of free pages until at most ``keep_free`` created pages are
        free (mapped pages are never touched; their ids stay valid and can be created again).
        Returns the pages released."""
        if isinstance(keep_free, bool) or not isinstance(keep_free, int) or keep_free < 0:
            raise ValueError(f"keep_free must be a non-negative int, got {keep_free!r}")
        n = len(self._free) - keep_free
        if n <= 0:
            return 0
        pages = sorted(self._free[-n:])  # the lowest ids stay (pop() takes from the end)
        self._store.release(pages)
        del self._free[-n:]
        for p in pages:
            self._dirty[p] = False  # created again, it reads as zeros
        self._uncreated.extend(pages)
        self._uncreated.sort(reverse=True)
        self._created -= n
        self.budget.release(n)
        return n

    def release_all(self, live: list[int]) -> None:
        """Sleep: release the memory of every created page, the ``live`` ones (every page
        with a reference, :meth:`used_pages`) too: their refcounts and ids stay, and
        :meth:`recreate` brings them back."""
        self.trim(0)
        if live:
            self._store.release(live)
            self.budget.release(len(live))
            self._created -= len(live)
        self.asleep = True

    def recreate(self, live: list[int], fill=None) -> None:
        """Wake: create ``live`` again (all or nothing; ``CacheFull`` if the budget or the
        device refuses, and the pool stays asleep). ``fill(pages)``: the store calls it as
        each chunk of pages exists (a wake restores their bytes meanwhile)."""
        if not self.budget.acquire(len(live)):
            room = self.budget.available()
            raise CacheFull(f"memory budget: waking needs {len(live)} pages, {room} allowed",
                            wanted=len(live), free=room)  # fmt: skip
        try:
            if fill is None:
                self._store.create(sorted(live))
            else:
                self._store.create(sorted(live), fill=fill)
        except BaseException as exc:
            self.budget.release(len(live))
            _raise_full_if_oom(exc, f"waking {len(live)} pages", len(live), 0)
            raise
        self._created += len(live)
        self.asleep = False


def _raise_full_if_oom(exc: BaseException, what: str, wanted: int, free: int) -> None:
    """A driver's out-of-memory answer is exhaustion: ``CacheFull`` (the docstrings' promise),
    not a ``DriverError``."""
    if isinstance(exc, DriverError) and (
        "OUT_OF_MEMORY" in exc.code or exc.code in ("ENOMEM", "ENOSPC")
    ):
        raise CacheFull(f"device memory exhausted {what} ({exc})", wanted=wanted,
                        free=free) from exc  # fmt: skip
