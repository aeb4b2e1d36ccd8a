"""Prefix index: full pages of K/V found again by their tokens, across requests.

A chain of entries, one per full page of ``tokens_per_page`` tokens; an entry's key is
(parent entry, the page's token ids, tenant salt), so a page is found only after the same
tokens *and* the same prefix before them, and never across salts:

    "You are a helpful ... | ... assistant. User: | hi"      (pages of 4 tokens)
     entry A -------------> entry B -------------> (tail: not a full page, not indexed)
     pages (a0, a1, ...)    pages (b0, b1, ...)    one page per table (T tables)

Every entry holds one pool reference per page, so cached pages outlive the sequence that
wrote them. Entries whose pages nobody else maps (refcount 1) are evictable, least recently
used first (a chain's entries share the tick of their last use), leaves before parents; the
pool calls :meth:`reclaim` before it would raise ``CacheFull``. :meth:`reclaimable` counts
only what eviction can really free: an entry whose pages nobody else maps but below which a
sequence still maps a descendant stays, so its pages do not count (a scheduler trusts
``can_grow``). The index alone changes its entries; refcounts change only through the pool.

    A (alone) ── B (mapped by a sequence) ── C (alone)
    evictable now: C.   reclaimable: C's pages only (A waits for B).
"""

from __future__ import annotations

import heapq
import itertools
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
    blocked: int = 0  # children whose subtrees are not wholly reclaimable
    whole: bool = False  # its pages and every descendant's are only the index's

    @property
    def freeable(self) -> bool:
        return self.alone == len(self.pages) and self.blocked == 0


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
    # leaves whose pages only the index holds; _lru orders them by last use, lazily (an
    # item is stale once its entry left _evictable or was used again): O(log n) an eviction
    _evictable: dict[tuple, _Entry] = field(default_factory=dict)
    _lru: list[tuple[int, int, tuple]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)
    _whole_pages: int = 0  # pages of entries whose whole subtree eviction can free

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
            self._touch(e)
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
                    parent.blocked += 1  # e is not wholly reclaimable until _refresh says so
                    self._refresh(parent)
                self._refresh(e)
                new += len(e.pages)
            self._touch(e)
            parent = e
        self._stats.inserted_pages += new
        return new

    def _touch(self, e: _Entry) -> None:
        e.last_used = self._tick
        if e.key in self._evictable:  # used now: its old place in _lru goes stale
            self._push(e)

    def _push(self, e: _Entry) -> None:
        if len(self._lru) > 2 * len(self._evictable) + 64:  # mostly stale: rebuild
            self._lru = [(x.last_used, next(self._order), k) for k, x in self._evictable.items()]
            heapq.heapify(self._lru)
        heapq.heappush(self._lru, (e.last_used, next(self._order), e.key))

    def _refresh(self, e: _Entry | None) -> None:
        """After ``e``'s pages or children changed: its place among the evictable leaves,
        and whether its subtree is wholly reclaimable (which may change its parent's, and
        so on up the chain: O(depth))."""
        while e is not None and e.key in self._entries:
            evictable = e.children == 0 and e.alone == len(e.pages)
            if evictable and e.key not in self._evictable:
                self._evictable[e.key] = e
                self._push(e)
            elif not evictable:
                self._evictable.pop(e.key, None)
            if e.freeable == e.whole:
                return
            e.whole = e.freeable
            self._whole_pages += len(e.pages) if e.whole else -len(e.pages)
            if e.parent is not None:
                e.parent.blocked += -1 if e.whole else 1
            e = e.parent

    def alone_changed(self, page: int, alone: bool) -> None:
        """The pool's notice that an indexed page's refcount reached or left 1."""
        e = self._of_page.get(page)
        if e is not None:
            e.alone += 1 if alone else -1
            self._refresh(e)

    def reclaimable(self) -> int:
        """Pages that eviction could return to the pool now: those of entries whose pages,
        and every descendant's, only the index holds (kept as refcounts change, O(1) here)."""
        return self._whole_pages

    def _pop_lru(self) -> _Entry:
        while True:
            used, _, key = heapq.heappop(self._lru)
            e = self._evictable.get(key)
            if e is not None and e.last_used == used:
                return e

    def reclaim(self, pages: int) -> int:
        """Evict unreferenced leaves, least recently used first (a parent becomes a leaf when
        its last child goes, and takes its own place by its last use), until ``pages`` pages
        went back to the pool or nothing evictable is left; returns pages freed.
        O(log entries) per entry evicted."""
        freed = 0
        while freed < pages and self._evictable:
            e = self._pop_lru()
            del self._evictable[e.key], self._entries[e.key]
            self._whole_pages -= len(e.pages)  # a leaf alone in its pages: it was whole
            for p in e.pages:
                del self._of_page[p]
            if e.parent is not None:
                e.parent.children -= 1
                self._refresh(e.parent)
            self.pool.set_indexed(e.pages, False)
            self.pool.decref(e.pages)
            freed += len(e.pages)
            self._stats.evicted_pages += len(e.pages)
        return freed

    def clear(self) -> int:
        """Evict everything evictable (pages still mapped by sequences stay)."""
        return self.reclaim(self.pool.num_pages)

    def forget(self) -> int:
        """Drop every entry, also those whose pages sequences map (their K/V are about to be
        lost: a sleep that keeps nothing); returns the references dropped."""
        pages = [p for e in self._entries.values() for p in e.pages]
        self._entries.clear()
        self._of_page.clear()
        self._evictable.clear()
        self._lru.clear()
        self._whole_pages = 0
        self.pool.set_indexed(pages, False)
        self.pool.decref(pages)
        self._stats.evicted_pages += len(pages)
        return len(pages)

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
