"""The invariants every cache keeps (checked by tests and soak runs; O(pages)):

1. a page's refcount = the (sequence, table, index) entries, reserved pages and prefix-index
   references that hold it;
2. a created page is on the free list iff its refcount is 0, and at most once;
plus the bookkeeping around them: tables as long as lengths need, the index's count of pages
only it holds, slots, and token ids (known ones as many as the length, no list shared).
"""

from __future__ import annotations

from vmcache.errors import require
from vmcache.sequences.tables import RELEASED


def check_invariants(cache) -> None:
    """Raise :class:`~vmcache.errors.InvariantError` at the first invariant that fails."""
    c = cache._core  # what its coordinator hands its core and facets
    counts: dict[int, int] = {}  # page -> references found
    for s in c.cache.sequences:
        for p in (p for g in c.groups for t in g.ahead(s) for p in t):
            counts[p] = counts.get(p, 0) + 1
    for p in c.cache.prefix.index.references() if c.cache.prefix.enabled else []:
        counts[p] = counts.get(p, 0) + 1
    for s in c.cache.sequences:
        for g in c.groups:
            rows, first, length = g.rows(s), g.first(s), c.seqs.length(s)
            require(len(rows) == len(g.ids))
            # a window releases only what the next query (and a rollback) cannot read
            require(first <= g.keep_page(length, 0), "released too much", s)
            for t in rows:
                require(len(t) == g.pages_for(length), (s, len(t), length))
                require(all(p == RELEASED for p in t[:first]), "released entries", s)
                for p in t[first:]:
                    require(p >= 0, "a mapped entry holds no page", s)
                    counts[p] = counts.get(p, 0) + 1
    live = set(c.cache.sequences)
    for s in range(c.config.max_seqs):
        if s not in live:
            require(all(g._rows[s] is None for g in c.groups), "a free slot has tables", s)
    pool = c.pool
    for p in range(pool.num_pages):
        require(pool.refcount(p) == counts.get(p, 0), (p, pool.refcount(p), counts.get(p)))
    free, uncreated = set(pool._free), set(pool._uncreated)
    require(len(free) == len(pool._free), "a page is twice on the free list")
    require(len(uncreated) == len(pool._uncreated) and not free & uncreated, "page lists")
    for p in range(pool.num_pages):  # created: free iff unreferenced; uncreated: unreferenced
        require((p in free) == (pool.refcount(p) == 0) or p in uncreated, p)
        require(p not in uncreated or pool.refcount(p) == 0, "a live page has no memory", p)
    require(pool.num_created == pool.num_pages - len(uncreated), "created count")
    held = getattr(pool.budget, "held", None)
    require(held is None or held == pool.num_created, "budget", held, pool.num_created)
    require(pool.num_used == len(counts))
    indexed = set(c.cache.prefix.index.references()) if c.cache.prefix.enabled else set()
    require(indexed == {p for p in range(pool.num_pages) if pool._indexed[p]})
    require(pool.index_only == sum(1 for p in indexed if pool.refcount(p) == 1))
    require(pool.num_shared == sum(1 for p in range(pool.num_pages) if pool.refcount(p) > 1))
    if c.cache.prefix.enabled:  # the eviction queue holds exactly the evictable leaves
        ix = c.cache.prefix.index
        want = {e.key for e in ix._entries.values()
                if e.children == 0 and all(pool.refcount(p) == 1 for p in e.pages)}  # fmt: skip
        require(set(ix._evictable) == want, "prefix eviction queue", len(want))
        # reclaimable: pages of entries whose whole subtree only the index holds, recounted
        kids: dict[int, list] = {}
        for e in ix._entries.values():
            kids.setdefault(id(e.parent), []).append(e)

        def whole(e) -> bool:
            mine = all(pool.refcount(p) == 1 for p in e.pages)
            return all([whole(c) for c in kids.get(id(e), [])]) and mine

        free = sum(len(e.pages) for e in ix._entries.values() if whole(e))
        require(ix.reclaimable() == free, "prefix reclaimable pages", ix.reclaimable(), free)
    slots = c.seqs
    require(sorted(slots.free_slots() + c.cache.sequences) == list(range(c.config.max_seqs)))
    for s in c.cache.sequences:
        known = slots.known_tokens(s)
        require(known is None or known == slots.length(s), "token ids", s, known)
    require(slots.owns_token_lists(), "two sequences share one token list")
