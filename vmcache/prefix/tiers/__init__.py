"""Tiers for the prefix index: evicted prefix pages kept in host RAM and on disk, and
promoted back to the device on a hit instead of recomputed."""

from vmcache.prefix.tiers.tiers import PrefixTiers, TierStats

__all__ = ["PrefixTiers", "TierStats"]
