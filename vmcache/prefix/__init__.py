"""Prefix caching: the index of cached full pages (token ids and a tenant salt to pages, LRU
eviction), its tiers in host RAM and on disk, and the coordinator's prefix operations."""

from vmcache.prefix.index import PrefixIndex, PrefixStats

__all__ = ["PrefixIndex", "PrefixStats"]
