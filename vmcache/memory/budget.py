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
