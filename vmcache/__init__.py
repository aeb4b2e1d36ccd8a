"""vmcache: a virtual-memory KV cache for LLM inference (vAttention-style), with a
block-table paged cache beside it for A/B measurements."""

from .cache import VMKVCache
from .errors import CacheFull, DriverError, InvariantError, MapLimitError
from .pool import PagePool
from .spec import KVSpec
from .stats import CacheStats
from .tiers import PrefixTiers
from .transfer import SwapHandle

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
