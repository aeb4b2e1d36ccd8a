"""Cache statistics: one dataclass for both caches, so benchmarks compare like with like."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheStats:
    num_sequences: int
    num_tokens: int  # sum of sequence lengths (logical, shared tokens counted per sequence)
    page_bytes: int  # bytes one page (VMKVCache) or one block id (PagedKVCache) stands for
    mapped_bytes: int  # logical: page-table entries × page_bytes
    used_bytes: int  # num_tokens × bytes_per_token
    physical_pages: int  # distinct pages in use
    physical_bytes: int  # physical_pages × page_bytes
    shared_pages: int  # pages with refcount > 1
    free_pages: int
    total_pages: int
    cow_copies: int = 0  # pages copied on write so far
    cow_bytes_copied: int = 0  # bytes those copies moved

    @property
    def internal_waste(self) -> float:
        """Fraction of mapped bytes that hold no token: (mapped − used) / mapped."""
        return 0.0 if self.mapped_bytes == 0 else 1.0 - self.used_bytes / self.mapped_bytes

    @property
    def cow_saving(self) -> float:
        """Copy-on-write saving: (logical − physical) / logical."""
        if self.mapped_bytes == 0:
            return 0.0
        return (self.mapped_bytes - self.physical_bytes) / self.mapped_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d["internal_waste"] = self.internal_waste
        d["cow_saving"] = self.cow_saving
        return d
