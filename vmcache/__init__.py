"""vmcache: a virtual-memory KV cache for LLM inference (vAttention-style), with a
block-table paged cache beside it for A/B measurements."""

from vmcache.cache import VMKVCache
from vmcache.errors import CacheFull, DriverError, InvariantError, MapLimitError
from vmcache.pool import PagePool
from vmcache.spec import KVSpec
from vmcache.stats import CacheStats
from vmcache.tiers import PrefixTiers
from vmcache.transfer import SwapHandle

__all__ = [
    "KVSpec",
    "VMKVCache",
    "CacheFull",
    "DriverError",
    "MapLimitError",
    "InvariantError",
    "PagePool",
    "SwapHandle",
    "PrefixTiers",
    "CacheStats",
]
__version__ = "0.1.0"
