"""The prefix operations of :class:`~vmcache.seqcache.SequenceCache`: turning prefix caching
(and its tiers) on, attaching a new sequence's cached prefix, indexing a sequence's pages.
They touch the cache's lengths, token ids and salts and its one full-attention group; the
:class:`~vmcache.prefix.PrefixIndex` owns its entries, the pool the refcounts."""

from __future__ import annotations

from .prefix import PrefixIndex


class PrefixOps:
    """new_sequence(prefix_tokens=...)'s attach step and cache_prefix: operations of
    :class:`~vmcache.seqcache.SequenceCache` (its lengths, token ids, salts and its one
    full-attention group; prefix caching is refused for sliding-window models)."""

    def _setup_prefix(self, prefix_caching: bool, prefix_tiers) -> None:
        if not prefix_caching:
            if prefix_tiers is not None:
                raise ValueError("prefix_tiers needs prefix_caching=True")
            return
        if any(g.sliding for g in self.groups):
            raise ValueError(
                "prefix caching is not supported for models with sliding-window layers "
                f"(layers {list(self.spec.sliding_layers)}): a cached prefix would need the "
                "pages those layers release"
            )
        u, P = self.groups[0].u, self.groups[0].P
        if P % u:
            raise ValueError(f"prefix caching needs pages of whole tokens; {P} % {u} != 0")
        self.prefix = PrefixIndex(self.pool, P // u, self._T)
        self.pool.reclaimer = self.prefix
        if prefix_tiers is not None:
            self._bind_tiers(prefix_tiers)

    def _attach_prefix(self, s: int, tokens: list[int]) -> None:
        limit = self.max_seq_len // self.prefix.tokens_per_page
        entries = self.prefix.match(tokens, self._salts[s], max_pages=limit)
        if not entries:
            return
        (g,) = self.groups
        rows = [[e.pages[i] for e in entries] for i in range(self._T)]
        self._attach_row(s, g.ids, 0, rows)
        self.pool.incref([p for r in rows for p in r])
        n = len(entries) * self.prefix.tokens_per_page
        g.open(s, rows)
        self._tokens[s] = list(tokens[:n])
        self._set_len(s, n)

    def _close_tiers(self) -> None:
        """The disk tier's directory given up (the cache's close)."""
        if self.prefix is not None and self.prefix.tiers is not None:
            self.prefix.tiers.close()

    def _bind_tiers(self, tiers) -> None:
        from .tiers import PrefixTiers

        if not isinstance(tiers, PrefixTiers):
            raise TypeError(f"prefix_tiers must be a PrefixTiers, got {type(tiers).__name__}")
        ix = self.prefix
        layout = {"cache": type(self).__name__, "spec": repr(self.spec), "tables": self._T,
                  "layout": getattr(self, "layout", None), "page_bytes": self.page_bytes,
                  "tokens_per_page": ix.tokens_per_page}  # fmt: skip
        ix.root = tiers.bind(layout, self._T * self.page_bytes)
        ix.tiers, ix.read_pages, ix.write_pages = tiers, self._read_pages, self._write_pages

    def tier_stats(self):
        """The prefix tiers' :class:`~vmcache.tiers.TierStats` (None without tiers)."""
        ix = self.prefix
        return None if ix is None or ix.tiers is None else ix.tiers.stats(self._T)

    def cached_prefix_tokens(self, tokens, salt=None) -> int:
        """How many leading tokens of ``tokens`` a new sequence would find cached under
        ``salt`` now (0 without prefix caching); changes nothing."""
        return 0 if self.prefix is None else self.prefix.peek(list(tokens), salt)

    def cache_prefix(self, s: int) -> int:
        """Index sequence ``s``'s full pages of known tokens now (``free`` does it too), so
        requests that arrive while it runs share them; call it once their K/V are written.
        Returns the pages newly indexed (0 without prefix caching or known token ids)."""
        s = self._check_seq(s)
        tokens = self._tokens[s]
        if self.prefix is None or tokens is None:
            return 0
        n = min(len(tokens), self._lens[s])
        return self.prefix.insert(tokens[:n], self.groups[0].rows(s), self._salts[s])
