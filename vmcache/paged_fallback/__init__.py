"""Block-table paged KV cache (vLLM-style), the A/B twin of VMKVCache."""

from vmcache.paged_fallback.cache import PagedKVCache, block_address

__all__ = ["PagedKVCache", "block_address"]
