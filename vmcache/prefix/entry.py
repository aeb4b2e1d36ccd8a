"""The prefix index's records: an entry (one span's pages, or a tail's), the index's
counters, and the page arithmetic a scheduler shares with it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def whole_pages_shared(a: Iterable[int], b: Iterable[int], page: int) -> int:
    """Leading tokens ``a`` and ``b`` have in common, rounded down to whole pages of ``page``
    tokens (what one could reuse from the other's cached pages)."""
    common = 0
    for x, y in zip(a, b):
        if x != y:
            break
        common += 1
    return common // page * page


@dataclass(eq=False)
class Entry:
    key: tuple
    parent: Entry | None
    pages: tuple[int, ...]  # k physical pages per table, table by table
    children: int = 0
    last_used: int = 0
    alone: int = 0  # of its pages, those only the index holds (refcount 1)
    blocked: int = 0  # children whose subtrees are not wholly reclaimable
    whole: bool = False  # its pages and every descendant's are only the index's
    digest: bytes = b""  # its name in the tiers (with tiers only)
    unit_keys: tuple = ()  # its keys in the index's Tails (found by unit prefixes)
    partial: bool = False  # a tail: a sequence's partial last span

    @property
    def freeable(self) -> bool:
        return self.alone == len(self.pages) and self.blocked == 0


@dataclass
class PrefixStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0  # tokens served from the index (their K/V not recomputed)
    tier_hit_tokens: int = 0  # of those, tokens promoted from host RAM or disk
    inserted_pages: int = 0
    evicted_pages: int = 0
    cached_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


__all__ = ["Entry", "PrefixStats", "whole_pages_shared"]
