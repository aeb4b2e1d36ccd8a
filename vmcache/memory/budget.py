"""How many physical pages a pool may hold: a budget the pool asks before it creates pages and
tells when it releases them. :class:`LocalBudget` is one process's limit (changeable at run
time: shrink and grow); :class:`vmcache.memory.ledger.SharedBudget` draws from a budget several
processes share.

    pool:   created pages = in use + free (physical)   |  not created (no memory)
    budget: held = created pages                       |  may acquire up to the limit
"""

from __future__ import annotations

from typing import Protocol


class Budget(Protocol):
    def acquire(self, n: int) -> bool:
        """Take ``n`` pages, all or nothing; False when the budget cannot give them now."""

    def release(self, n: int) -> None:
        """Give back ``n`` pages taken earlier."""

    def available(self) -> int:
        """Pages :meth:`acquire` would give now."""

    def excess(self) -> int:
        """Pages held beyond the limit (a limit lowered below what is held): the pool
        releases free pages until this is 0."""


class LocalBudget:
    """A limit of ``limit_pages`` for one pool (``set_limit`` moves it; lowering it below
    what is held takes nothing away: the pool releases free pages, then holds what its
    sequences map until they shrink)."""

    def __init__(self, limit_pages: int) -> None:
        self.limit = _pages("limit_pages", limit_pages)
        self.held = 0  # owned here: pages acquired and not released

    def set_limit(self, limit_pages: int) -> None:
        self.limit = _pages("limit_pages", limit_pages)

    def acquire(self, n: int) -> bool:
        if self.held + n > self.limit:
            return False
        self.held += n
        return True

    def release(self, n: int) -> None:
        if n > self.held:
            raise ValueError(f"release of {n} pages, {self.held} held")
        self.held -= n

    def available(self) -> int:
        return max(0, self.limit - self.held)

    def excess(self) -> int:
        return max(0, self.held - self.limit)


def _pages(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return n


class ScaledBudget:
    """A cache's pages counted in a budget's smaller units: ``units_per_page`` units a page
    (several caches with different page sizes drawing on one byte-denominated ledger, e.g.
    4 KiB units under 64 KiB VMKVCache pages and PagedKVCache blocks of any size). Forwards
    ``want`` when the inner budget has it (a shared budget stays shared). ``unit_bytes``
    instead: the scale is bound from the page size by :meth:`bind_page_bytes` (a cache's
    page size is known once it is built), before the first call."""

    def __init__(self, inner: Budget, units_per_page: int | None = None, *,
                 unit_bytes: int | None = None) -> None:  # fmt: skip
        if (units_per_page is None) == (unit_bytes is None):
            raise ValueError("give exactly one of units_per_page and unit_bytes")
        if units_per_page is not None and _pages("units_per_page", units_per_page) < 1:
            raise ValueError("units_per_page must be at least 1")
        if unit_bytes is not None and _pages("unit_bytes", unit_bytes) < 1:
            raise ValueError("unit_bytes must be at least 1")
        self.inner, self._k, self.unit_bytes = inner, units_per_page, unit_bytes
        if hasattr(inner, "want"):
            self.want = inner.want

    def bind_page_bytes(self, page_bytes: int) -> None:
        """Units a page from the page's size (rounded up)."""
        if self._k is not None:
            raise RuntimeError("the scale is bound already")
        self._k = -(-_pages("page_bytes", page_bytes) // self.unit_bytes)

    @property
    def k(self) -> int:
        if self._k is None:
            raise RuntimeError("ScaledBudget used before bind_page_bytes")
        return self._k

    def acquire(self, n: int) -> bool:
        return self.inner.acquire(_pages("pages", n) * self.k)

    def release(self, n: int) -> None:
        self.inner.release(_pages("pages", n) * self.k)

    def available(self) -> int:
        return self.inner.available() // self.k

    def excess(self) -> int:
        return -(-self.inner.excess() // self.k)
