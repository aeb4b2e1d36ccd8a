"""vmcache: a virtual-memory KV cache for LLM inference (vAttention-style), with a
block-table paged cache beside it for A/B measurements.

    vmcache.memory      physical memory: backends, page store, pool, budgets, ledger
    vmcache.prefix      prefix index and its RAM / disk tiers
    vmcache.sequences   KVSpec, page tables, the coordinator and its facets, VMKVCache
    vmcache.kernels     attention over either cache;  vmcache.paged_fallback  PagedKVCache
    vmcache.hf / .engine / .distributed / .serve   the ways in;  vmcache.bench  the harness
"""

from vmcache.errors import CacheFull, DriverError, InvariantError, MapLimitError
from vmcache.memory.budget import LocalBudget
from vmcache.memory.ledger import SharedBudget
from vmcache.memory.pool import PagePool
from vmcache.prefix.tiers import PrefixTiers
from vmcache.sequences.cache import VMKVCache
from vmcache.sequences.config import CacheConfig
from vmcache.sequences.handoff import SwapHandle
from vmcache.sequences.invariants import check_invariants
from vmcache.sequences.spec import KVSpec
from vmcache.sequences.stats import CacheStats

__all__ = [
    "KVSpec",
    "VMKVCache",
    "CacheFull",
    "DriverError",
    "MapLimitError",
    "InvariantError",
    "PagePool",
    "LocalBudget",
    "SharedBudget",
    "SwapHandle",
    "PrefixTiers",
    "CacheStats",
    "CacheConfig",
    "check_invariants",
]
__version__ = "0.1.0"
