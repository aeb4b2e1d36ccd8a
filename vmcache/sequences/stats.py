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
    window_released_pages: int = 0  # page-table entries sliding windows gave back so far
    plans_built: int = 0  # step plans the kernels built (one device upload each)

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


def collect_stats(core) -> CacheStats:
    """A :class:`CacheStats` of a :class:`~vmcache.sequences.coordinator.SequenceCache` (reads its
    lengths, groups and pool; changes nothing)."""
    live = core.cache.sequences
    entries = sum(len(g.ids) * (g.num_pages(s) - g.first(s)) for s in live for g in core.groups)
    pool = core.pool.stats()
    return CacheStats(
        num_sequences=len(live),
        num_tokens=sum(core.seqs.length(s) for s in live),
        page_bytes=core.config.page_bytes,
        mapped_bytes=entries * core.config.page_bytes,
        used_bytes=sum(_held_bytes(core, s) for s in live),
        physical_pages=pool.used_pages,
        physical_bytes=pool.used_pages * core.config.page_bytes,
        shared_pages=pool.shared_pages,
        free_pages=pool.free_pages,
        total_pages=pool.num_pages,
        cow_copies=core.tx.cow_copies,
        cow_bytes_copied=core.tx.cow_bytes_copied,
        window_released_pages=sum(g.released_pages for g in core.groups),
        plans_built=core.cache.views.plans_built,
    )


def _held_bytes(core, s: int) -> int:
    """K/V bytes of ``s``'s tokens its tables still map (released ones not counted)."""
    length = core.seqs.length(s)
    return sum(len(g.ids) * (length - min(g.first_token(s), length)) * core.config.page_bytes
               * g.u // g.P for g in core.groups)  # fmt: skip
