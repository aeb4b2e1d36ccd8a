"""Physical memory: backends (CUDA driver VMM, Linux mmap + memfd, the strict CUDA page rules,
sizing), the page store (every page mapped once in a private window), the page pool (ids,
free list, refcounts: their only owner) and the budgets it asks (a local limit, a ledger
several processes share). Nothing here knows of sequences."""

from vmcache.memory.budget import Budget, LocalBudget
from vmcache.memory.ledger import LedgerError, SharedBudget
from vmcache.memory.pool import PagePool

__all__ = ["Budget", "LocalBudget", "LedgerError", "PagePool", "SharedBudget"]
