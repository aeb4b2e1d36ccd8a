"""Prefix caching of a cache (``cache.prefix``): turning it (and its tiers) on, finding what a
new sequence's prefix has cached, indexing a sequence's pages, and the questions a scheduler
asks.

    index                 the :class:`~vmcache.prefix.index.PrefixIndex` (None when off):
                          its entries, LRU eviction, stats, tiers
    enabled               whether prefix caching is on
    tokens_per_entry      tokens one index entry holds: the least run of whole pages that
                          ends on a whole token (None when off)
    hit_unit              the granularity of a hit in tokens: 16 (a partial entry found in
                          16-token units) or the entry when it is shorter (None when off)
    hit(s, ids)           per table, the cached pages a new sequence ``s`` starting with
                          ``ids`` maps, and the tokens they hold (the coordinator's
                          ``new_sequence`` maps them: ``tx.share_rows``)
    publish(s)            index ``s``'s full pages of known tokens now (``free`` does it too)
    cached_tokens(ids)    leading tokens a new sequence would find cached now
    tier_stats()          the tiers' counters (None without tiers)

Touches, through the core it is handed (:mod:`.core`): lengths, token ids and salts (read),
the index (``hit`` marks the entries it finds as used; the index is the pool's reclaimer) and
the cache's page hooks (``_read_pages``, ``_write_pages``) for the tiers; it maps no page.
The index owns its entries, the pool the refcounts. Refused for sliding-window models.
"""

from __future__ import annotations

import math

from vmcache.prefix.index import PrefixIndex
from vmcache.sequences.transactions import IndexRefs


class Prefix:
    """``cache.prefix``: the prefix index of a cache and the calls that feed it."""

    def __init__(self, core, prefix_caching: bool, prefix_tiers) -> None:
        c = self._c = core
        self.index: PrefixIndex | None = None  # owned here; holds pool references
        if not prefix_caching:
            if prefix_tiers is not None:
                raise ValueError("prefix_tiers needs prefix_caching=True")
            return
        if any(g.sliding for g in c.groups):
            raise ValueError(
                "prefix caching is not supported for models with sliding-window layers "
                f"(layers {list(c.spec.sliding_layers)}): a cached prefix would need the "
                "pages those layers release"
            )
        u, P = c.groups[0].u, c.groups[0].P  # a token's and a page's units in one table
        k = math.lcm(P, u) // P  # pages per span: the least run of whole pages ending on a token
        self.index = PrefixIndex(IndexRefs(c.pool), k * P // u, c.T * k, k)
        c.pool.reclaimer = self.index
        if prefix_tiers is not None:
            self._bind_tiers(prefix_tiers)

    @property
    def enabled(self) -> bool:
        return self.index is not None

    @property
    def tokens_per_entry(self) -> int | None:
        return None if self.index is None else self.index.tokens_per_entry

    @property
    def hit_unit(self) -> int | None:
        return None if self.index is None else self.index.hit_unit

    def hit(self, s: int, tokens: list[int]) -> tuple[list[list[int]], int] | None:
        """What new sequence ``s`` (of ``s``'s salt) finds cached at the start of ``tokens``:
        per table, the pages of the cached spans that begin them and of a partial span's
        tail after them, and the tokens those hold; None when nothing. Changes no table (the
        coordinator maps the pages, ``tx.share_rows``: nothing copied, the first write into
        a shared page copies it); the index marks the entries found as recently used."""
        c, ix = self._c, self.index
        P, salt = ix.tokens_per_entry, c.seqs.salt(s)
        entries = ix.match(tokens, salt, max_pages=c.config.max_seq_len // P)
        full = len(entries) * P
        tail, extra = ix.match_tail(entries[-1] if entries else None, tokens, len(entries), salt,
                                    limit=c.config.max_seq_len - full)  # fmt: skip
        if not entries and tail is None:
            return None
        k = ix.pages_per_table
        rows = [[p for e in entries for p in e.pages[i * k : (i + 1) * k]] for i in range(c.T)]
        if tail is not None:  # the pages its matched units lie in, of each table's
            per, need = len(tail.pages) // c.T, ix.pages_over(extra)
            for i, r in enumerate(rows):
                r += tail.pages[i * per : i * per + need]
        return rows, full + extra

    def close_tiers(self) -> None:
        """The disk tier's directory given up (the cache's close)."""
        if self.index is not None and self.index.tiers is not None:
            self.index.tiers.close()

    def _bind_tiers(self, tiers) -> None:
        from vmcache.prefix.tiers import PrefixTiers

        if not isinstance(tiers, PrefixTiers):
            raise TypeError(f"prefix_tiers must be a PrefixTiers, got {type(tiers).__name__}")
        c, ix = self._c, self.index
        kind = c.config.layout
        layout = {"cache": type(c).__name__, "spec": repr(c.spec), "tables": c.T,
                  "layout": None if kind == "paged" else kind, "page_bytes": c.config.page_bytes,
                  "tokens_per_page": ix.tokens_per_entry}  # fmt: skip
        if ix.pages_per_table > 1:  # (absent for one page a span: older tier files still match)
            layout["pages_per_table"] = ix.pages_per_table
        ix.root = tiers.bind(layout, ix.pages_per_entry * c.config.page_bytes)
        ix.tiers, ix.read_pages, ix.write_pages = tiers, c.read_pages, c.write_pages

    def tier_stats(self):
        """The prefix tiers' :class:`~vmcache.prefix.tiers.TierStats` (None without tiers)."""
        ix = self.index
        return None if ix is None or ix.tiers is None else ix.tiers.stats(ix.pages_per_entry)

    def cached_tokens(self, tokens, salt=None) -> int:
        """How many leading tokens of ``tokens`` a new sequence would find cached under
        ``salt`` now (0 without prefix caching); changes nothing."""
        return 0 if self.index is None else self.index.peek(list(tokens), salt)

    def publish(self, s: int) -> int:
        """Index sequence ``s``'s full pages of known tokens now (``free`` does it too), so
        requests that arrive while it runs share them; call it once their K/V are written.
        Returns the pages newly indexed (0 without prefix caching or known token ids)."""
        c = self._c
        s = c.check_seq(s)
        tokens = c.seqs.tokens(s)
        if self.index is None or tokens is None:
            return 0
        n = c.seqs.length(s)
        return self.index.insert(tokens[:n], c.groups[0].rows(s), c.seqs.salt(s))
