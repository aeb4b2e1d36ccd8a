"""vmcache: a virtual-memory KV cache for LLM inference (vAttention-style), with a
block-table paged cache beside it for A/B measurements."""

from .cache import VMKVCache
from .errors import CacheFull, DriverError, MapLimitError
from .pool import PagePool
from .seqcache import SwapHandle
from .spec import KVSpec
from .stats import CacheStats

__all__ = [
    "KVSpec",
    "VMKVCache",
    "CacheFull",
    "DriverError",
    "MapLimitError",
    "PagePool",
    "SwapHandle",
    "CacheStats",
]
__version__ = "0.1.0"
