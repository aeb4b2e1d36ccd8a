"""Prefix index: full pages of K/V found again by their tokens, across requests.

A chain of entries, one per full page of ``tokens_per_page`` tokens; an entry's key is
(parent entry, the page's token ids, tenant salt), so a page is found only after the same
tokens *and* the same prefix before them, and never across salts:

    "You are a helpful ... | ... assistant. User: | hi"      (pages of 4 tokens)
     entry A -------------> entry B -------------> (tail: not a full page, not indexed)
     pages (a0, a1, ...)    pages (b0, b1, ...)    one page per table (T tables)

Every entry holds one pool reference per page, so cached pages outlive the sequence that
wrote them. Entries whose pages nobody else maps (refcount 1) are evictable, least recently
used first, leaves before parents; the pool calls :meth:`reclaim` before it would raise
``CacheFull``. The index alone changes its entries; refcounts change only through the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


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
class _Entry:
    key: tuple
    parent: _Entry | None
    pages: tuple[int, ...]  # one physical page per table
    children: int = 0
    last_used: int = 0
    alone: int = 0  # of its pages, those only the index holds (refcount 1)


@dataclass
class PrefixStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0  # tokens served from the index (their K/V not recomputed)
    inserted_pages: int = 0
    evicted_pages: int = 0
    cached_pages: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


@dataclass(eq=False)
class PrefixIndex:
    pool: object
    tokens_per_page: int
    num_tables: int
    _entries: dict[tuple, _Entry] = field(default_factory=dict)
    _tick: int = 0
    _stats: PrefixStats = field(default_factory=PrefixStats)
    _of_page: dict[int, _Entry] = field(default_factory=dict)  # page -> the entry holding it
    # leaves whose pages only the index holds, oldest release first: eviction is O(1) each
    _evictable: dict[tuple, _Entry] = field(default_factory=dict)

    def _key(self, parent: _Entry | None, tokens: Sequence[int], j: int, salt) -> tuple:
        """Page ``j`` of ``tokens`` after ``parent``: exact, so no two prefixes collide."""
        P = self.tokens_per_page
        return (id(parent), tuple(tokens[j * P : (j + 1) * P]), salt)

    def peek(self, tokens: Sequence[int], salt=None) -> int:
        """Tokens of ``tokens`` the index holds now (whole pages), touching nothing: no
        recency, no stats (for schedulers deciding whether to wait for a prefix)."""
        parent, j = None, 0
        while j < len(tokens) // self.tokens_per_page:
            parent = self._entries.get(self._key(parent, tokens, j, salt))
            if parent is None:
                break
            j += 1
        return j * self.tokens_per_page

    def match(self, tokens: Sequence[int], salt=None) -> list[_Entry]:
        """The longest run of cached full pages that starts ``tokens`` (touched as used)."""
        self._tick += 1
        found: list[_Entry] = []
        for j in range(len(tokens) // self.tokens_per_page):
            e = self._entries.get(self._key(found[-1] if found else None, tokens, j, salt))
            if e is None:
                break
            e.last_used = self._tick
            if self._evictable.pop(e.key, None) is not None:
                self._evictable[e.key] = e  # used now: the back of the eviction queue
            found.append(e)
        st = self._stats
        st.lookups += 1
        st.lookup_tokens += len(tokens)
        st.hit_tokens += len(found) * self.tokens_per_page
        return found

    def insert(self, tokens: Sequence[int], tables: Sequence[Sequence[int]], salt=None) -> int:
        """Index the full pages of a sequence holding ``tokens`` in ``tables`` (T page lists);
        pages already indexed keep their first copy. Returns the pages newly referenced."""
        self._tick += 1
        n = min(len(tokens) // self.tokens_per_page, min(len(t) for t in tables))
        new = 0
        parent = None
        for j in range(n):
            key = self._key(parent, tokens, j, salt)
            e = self._entries.get(key)
            if e is None:
                e = _Entry(key, parent, tuple(t[j] for t in tables))
                self.pool.incref(e.pages)
                for p in e.pages:
                    self._of_page[p] = e
                self.pool.set_indexed(e.pages, True)
                self._entries[key] = e
                if parent is not None:
                    parent.children += 1
                    self._update(parent)
                new += len(e.pages)
            e.last_used = self._tick
            parent = e
        self._stats.inserted_pages += new
        return new

    def _update(self, e: _Entry) -> None:
        """Keep ``e``'s place in the eviction queue: a leaf whose pages nobody else maps
        joins at the back (most recently released); anything else leaves it."""
        evictable = e.children == 0 and e.alone == len(e.pages) and e.key in self._entries
        if evictable and e.key not in self._evictable:
            self._evictable[e.key] = e
        elif not evictable:
            self._evictable.pop(e.key, None)

    def alone_changed(self, page: int, alone: bool) -> None:
        """The pool's notice that an indexed page's refcount reached or left 1."""
        e = self._of_page.get(page)
        if e is not None:
            e.alone += 1 if alone else -1
            self._update(e)

    def reclaimable(self) -> int:
        """Pages that eviction could return to the pool now: those only the index holds
        (counted by the pool as refcounts change, O(1) here)."""
        return self.pool.index_only

    def reclaim(self, pages: int) -> int:
        """Evict unreferenced leaves, least recently released first (a parent becomes a leaf
        when its last child goes), until ``pages`` pages went back to the pool or nothing
        evictable is left; returns pages freed. O(entries evicted)."""
        freed = 0
        while freed < pages and self._evictable:
            e = next(iter(self._evictable.values()))
            del self._evictable[e.key], self._entries[e.key]
            for p in e.pages:
                del self._of_page[p]
            if e.parent is not None:
                e.parent.children -= 1
                self._update(e.parent)
            self.pool.set_indexed(e.pages, False)
            self.pool.decref(e.pages)
            freed += len(e.pages)
            self._stats.evicted_pages += len(e.pages)
        return freed

    def clear(self) -> int:
        """Evict everything evictable (pages still mapped by sequences stay)."""
        return self.reclaim(self.pool.num_pages)

    def references(self) -> list[int]:
        """Every page reference the index holds (for invariant checks)."""
        return [p for e in self._entries.values() for p in e.pages]

    def stats(self) -> PrefixStats:
        st = self._stats
        st.cached_pages = sum(len(e.pages) for e in self._entries.values())
        return PrefixStats(**vars(st))


class PrefixOps:
    """new_sequence(prefix_tokens=...)'s attach step and cache_prefix: operations of
    :class:`~vmcache.seqcache.SequenceCache` (its lengths, token ids, salts and its one
    full-attention group; prefix caching is refused for sliding-window models)."""

    def _attach_prefix(self, s: int, tokens: list[int]) -> None:
        entries = self.prefix.match(tokens, self._salts[s])
        while entries and len(entries) * self.prefix.tokens_per_page > self.max_seq_len:
            entries.pop()
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
