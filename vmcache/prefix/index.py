"""Prefix index: full pages of K/V found again by their tokens, across requests.

A chain of entries, one per full span of ``tokens_per_entry`` tokens; an entry's key is
(parent entry, the span's token ids, tenant salt), so a span is found only after the same
tokens *and* the same prefix before them, and never across salts:

    "You are a helpful ... | ... assistant. User: | hi"      (spans of 4 tokens)
     entry A -------------> entry B -------------> (tail: a partial span)
     pages (a0, a1, ...)    pages (b0, b1, ...)    k pages per table (T tables)

A span longer than 16 tokens is also found by its first 16-token units, and a sequence's
partial last span is indexed (:mod:`vmcache.prefix.tails`: hits as fine as a 16-token paged
cache's).

A span is the least run of whole pages that ends on a whole token: one page (k = 1) when a
page holds whole tokens, else k = lcm(page, token row) / page pages (768-byte rows on 64 KiB
pages: k = 3, 256 tokens), so any head shape can share its prefixes. An entry holds its k
pages of table 0, then table 1's, ... (``pages_per_entry`` = T·k pages in all).

Every entry holds one reference per page, so cached pages outlive the sequence that
wrote them. Entries whose pages nobody else maps (refcount 1) are evictable, least recently
used first (a chain's entries share the tick of their last use), leaves before parents; the
pool calls :meth:`reclaim` before it would raise ``CacheFull``. :meth:`reclaimable` counts
only what eviction can really free: an entry whose pages nobody else maps but below which a
sequence still maps a descendant stays, so its pages do not count (a scheduler trusts
``can_grow``). The index alone changes its entries; it states the references it holds
(``refs``: hold, let go, take fresh pages, mark indexed) and the cache's transactional core
writes them into the pool's refcounts.

    A (alone) ── B (mapped by a sequence) ── C (alone)
    evictable now: C.   reclaimable: C's pages only (A waits for B).

With :class:`~vmcache.prefix.tiers.PrefixTiers`, evicted entries are demoted (their bytes read in
one copy before their pages go back) and a lookup that runs past the device entries promotes
the tiers' next pages into freshly allocated ones (:meth:`PrefixIndex._promote`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from vmcache.errors import CacheFull
from vmcache.prefix.entry import Entry, PrefixStats
from vmcache.prefix.tails import UNIT_TOKENS, Tails
from vmcache.prefix.tiers.digest import page_digest, salt_bytes


@dataclass(eq=False)
class PrefixIndex:
    refs: object  # the index's page references (sequences.transactions.IndexRefs)
    tokens_per_entry: int  # tokens one entry covers (its k pages per table end on a token)
    pages_per_entry: int  # T·k: the pages of one span in every table
    pages_per_table: int = 1  # k
    _entries: dict[tuple, Entry] = field(default_factory=dict)
    _tick: int = 0
    _stats: PrefixStats = field(default_factory=PrefixStats)
    _of_page: dict[int, Entry] = field(default_factory=dict)  # page -> the entry holding it
    # leaves whose pages only the index holds; _lru orders them by last use, lazily (an
    # item is stale once its entry left _evictable or was used again): O(log n) an eviction
    _evictable: dict[tuple, Entry] = field(default_factory=dict)
    _lru: list[tuple[int, int, tuple]] = field(default_factory=list)
    _order: itertools.count = field(default_factory=itertools.count)
    _whole_pages: int = 0  # pages of entries whose whole subtree eviction can free
    tiers: object = None  # a bound PrefixTiers (owns the demoted bytes), or None
    read_pages: Callable[[list[int]], torch.Tensor] | None = None  # the cache's page bytes
    write_pages: Callable[[list[int], torch.Tensor], None] | None = None
    root: bytes = b""  # the tiers' digest of the empty prefix
    tails: Tails | None = None  # partial spans' keys (None: the span is one unit already)

    def __post_init__(self) -> None:
        if self.tokens_per_entry > UNIT_TOKENS:
            self.tails = Tails(UNIT_TOKENS, self.tokens_per_entry)

    def pages_over(self, n_tokens: int) -> int:
        """Pages of one table a span's first ``n_tokens`` lie in (a partial hit's pages)."""
        return -(-n_tokens * self.pages_per_table // self.tokens_per_entry)

    @property
    def hit_unit(self) -> int:
        """The granularity of a hit in tokens."""
        return self.tokens_per_entry if self.tails is None else self.tails.unit

    def _key(self, parent: Entry | None, tokens: Sequence[int], j: int, salt) -> tuple:
        """Page ``j`` of ``tokens`` after ``parent``: exact, so no two prefixes collide."""
        P = self.tokens_per_entry
        return (id(parent), tuple(tokens[j * P : (j + 1) * P]), salt)

    def peek(self, tokens: Sequence[int], salt=None) -> int:
        """Tokens of ``tokens`` the index holds now (whole pages), touching nothing: no
        recency, no stats (for schedulers deciding whether to wait for a prefix)."""
        parent, j = None, 0
        while j < len(tokens) // self.tokens_per_entry:
            e = self._entries.get(self._key(parent, tokens, j, salt))
            if e is None:
                break
            parent, j = e, j + 1
        if self.tiers is not None:
            held = len(self._held(parent, tokens, salt, j, len(tokens) // self.tokens_per_entry))
            if held:
                return (j + held) * self.tokens_per_entry
        extra = 0 if self.tails is None else self.tails.find(parent, self._rest(tokens, j), salt)[1]
        return j * self.tokens_per_entry + extra

    def _rest(self, tokens: Sequence[int], j: int) -> Sequence[int]:
        return tokens[j * self.tokens_per_entry : (j + 1) * self.tokens_per_entry]

    def match_tail(self, parent: Entry | None, tokens: Sequence[int], j: int, salt=None,
                   limit: int | None = None) -> tuple[Entry | None, int]:  # fmt: skip
        """After the full spans ``match`` found (the last ``parent``, ``j`` of them): the tail
        sharing the most 16-token units with span ``j`` of ``tokens`` (at most ``limit``
        tokens), touched as used; (entry, tokens shared) or (None, 0)."""
        if self.tails is None:
            return None, 0
        rest = self._rest(tokens, j)
        e, n = self.tails.find(parent, rest[:limit] if limit is not None else rest, salt)
        if e is not None:
            self._touch(e)
            self._stats.hit_tokens += n
        return e, n

    def match(self, tokens: Sequence[int], salt=None, max_pages: int | None = None) -> list[Entry]:
        """The longest run of cached full pages (at most ``max_pages``) that starts
        ``tokens``, touched as used; with tiers, their next pages promoted if they hold them."""
        self._tick += 1
        found: list[Entry] = []
        n = len(tokens) // self.tokens_per_entry
        n = n if max_pages is None else min(n, max_pages)
        for j in range(n):
            e = self._entries.get(self._key(found[-1] if found else None, tokens, j, salt))
            if e is None:
                break
            self._touch(e)
            found.append(e)
        device = len(found)
        if self.tiers is not None and device < n:
            self._promote(found, tokens, salt, n)
        st = self._stats
        st.lookups += 1
        st.lookup_tokens += len(tokens)
        st.hit_tokens += len(found) * self.tokens_per_entry
        st.tier_hit_tokens += (len(found) - device) * self.tokens_per_entry
        return found

    def _held(self, parent, tokens, salt, j0: int, j1: int) -> list[bytes]:
        """Tier names of pages ``j0 ..`` of ``tokens`` (``parent`` holds page j0-1), as far
        as some tier holds them (no I/O; hashing stops at the first miss)."""
        P, sb = self.tokens_per_entry, salt_bytes(salt)
        d, out = parent.digest if parent is not None else self.root, []
        for j in range(j0, j1):
            d = page_digest(d, sb, tokens[j * P : (j + 1) * P])
            if d not in self.tiers:
                break
            out.append(d)
        return out

    def _promote(self, found: list[Entry], tokens, salt, n: int) -> None:
        """Extend ``found`` by the pages the tiers hold next: fresh pages allocated (which may
        evict, i.e. demote, colder entries; ``found`` is pinned meanwhile), filled in one copy,
        indexed like inserted ones. No room or a corrupt tier file: fewer (or no) pages."""
        T = self.pages_per_entry
        parent = found[-1] if found else None
        digests = self._held(parent, tokens, salt, len(found), n)
        want = len(digests)
        if want == 0:
            return
        pinned = [p for e in found for p in e.pages]
        self.refs.hold(pinned)  # not evictable while pages are found for the rest
        try:
            want = min(want, self.refs.num_available // T)
            try:
                pages = self.refs.take(want * T) if want else []
            except CacheFull:
                return
            blobs = self.tiers.fetch(digests[:want])
            if len(blobs) < want:
                self.refs.let_go(pages[len(blobs) * T :])
            if not blobs:
                return
            self.write_pages(pages[: len(blobs) * T], torch.stack(blobs).view(len(blobs) * T, -1))
            self.tiers.promoted(len(blobs))
            for i in range(len(blobs)):
                j = len(found)
                e = self._add(self._key(parent, tokens, j, salt), parent,
                              tuple(pages[i * T : (i + 1) * T]), digests[i])  # fmt: skip
                self._touch(e)
                found.append(e)
                parent = e
        finally:
            self.refs.let_go(pinned)

    def _add(self, key: tuple, parent: Entry | None, pages: tuple[int, ...], digest: bytes,
             partial: bool = False) -> Entry:  # fmt: skip
        """A new entry over ``pages`` (the index's reference already counted), found by its
        key (``key[1]``: its tokens) and by its unit prefixes."""
        e = Entry(key, parent, pages, digest=digest, partial=partial)
        self._entries[key] = e
        if self.tails is not None:
            e.unit_keys = self.tails.register(e, parent, key[1], key[2])
        for p in pages:
            self._of_page[p] = e
        if parent is not None:
            parent.children += 1
            parent.blocked += 1  # e is not wholly reclaimable until _refresh says so
            self._refresh(parent)
        self.refs.mark(pages, True)  # at refcount 1: alone_changed counts them
        self._refresh(e)
        return e

    def insert(self, tokens: Sequence[int], tables: Sequence[Sequence[int]], salt=None) -> int:
        """Index the full spans of a sequence holding ``tokens`` in ``tables`` (T page
        lists); spans already indexed keep their first copy. Returns the pages newly
        referenced."""
        self._tick += 1
        P, k = self.tokens_per_entry, self.pages_per_table
        n = min(len(tokens) // P, min(len(t) for t in tables) // k)
        new = 0
        parent = None
        for j in range(n):
            key = self._key(parent, tokens, j, salt)
            e = self._entries.get(key)
            if e is None:
                pages = tuple(t[j * k + m] for t in tables for m in range(k))
                for p in pages:  # the span a tail began, now whole: the tail gives way
                    held = self._of_page.get(p)
                    if held is not None and held.partial:
                        self._drop(held)
                self.refs.hold(pages)
                digest = b""
                if self.tiers is not None:
                    d = parent.digest if parent is not None else self.root
                    digest = page_digest(d, salt_bytes(salt), tokens[j * P : (j + 1) * P])
                e = self._add(key, parent, pages, digest)
                new += len(e.pages)
            self._touch(e)
            parent = e
        if self.tails is not None and n == len(tokens) // P:
            new += self._insert_tail(parent, tokens, tables, n, salt)
        self._stats.inserted_pages += new
        return new

    def _insert_tail(self, parent, tokens, tables, j: int, salt) -> int:
        """Span ``j`` of ``tokens``, partial, indexed as a tail over the pages its whole
        units lie in (skipped when it is indexed already or one of its pages is)."""
        rest = self._rest(tokens, j)
        units = self.tails.units(len(rest))
        if units == 0:
            return 0
        found, n = self.tails.find(parent, rest, salt)
        if n == units * self.tails.unit:  # as far as it goes, indexed already
            self._touch(found)
            return 0
        k, need = self.pages_per_table, self.pages_over(units * self.tails.unit)
        if min(len(t) for t in tables) < j * k + need:
            return 0
        pages = tuple(t[j * k + m] for t in tables for m in range(need))
        if any(p in self._of_page for p in pages):
            return 0
        self.refs.hold(pages)
        e = self._add((id(parent), tuple(rest[: units * self.tails.unit]), salt), parent, pages,
                      b"", partial=True)  # fmt: skip
        self._touch(e)
        return len(pages)

    def _drop(self, e: Entry) -> None:
        """Drop leaf ``e`` now, though sequences may map its pages (its references go)."""
        self._unlink(e)
        self.refs.mark(e.pages, False)
        self.refs.let_go(e.pages)

    def _unlink(self, e: Entry) -> None:
        """Leaf ``e`` out of the index's tables (its references not dropped yet)."""
        del self._entries[e.key]
        self._evictable.pop(e.key, None)
        if e.whole:
            self._whole_pages -= len(e.pages)
        for p in e.pages:
            del self._of_page[p]
        if self.tails is not None:
            self.tails.unregister(e, e.unit_keys)
        if e.parent is not None:
            e.parent.children -= 1
            e.parent.blocked -= 0 if e.whole else 1
            self._refresh(e.parent)

    def _touch(self, e: Entry) -> None:
        e.last_used = self._tick
        if e.key in self._evictable:  # used now: its old place in _lru goes stale
            self._push(e)

    def _push(self, e: Entry) -> None:
        if len(self._lru) > 2 * len(self._evictable) + 64:  # mostly stale: rebuild
            self._lru = [(x.last_used, next(self._order), k) for k, x in self._evictable.items()]
            heapq.heapify(self._lru)
        heapq.heappush(self._lru, (e.last_used, next(self._order), e.key))

    def _refresh(self, e: Entry | None) -> None:
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

    def _pop_lru(self) -> Entry:
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
        gone: list[Entry] = []
        freed = 0
        while freed < pages and self._evictable:
            e = self._pop_lru()
            self._unlink(e)  # a leaf alone in its pages: it was whole
            gone.append(e)
            freed += len(e.pages)
        self._demote_and_drop(gone)
        self._stats.evicted_pages += freed
        return freed

    def _demote_and_drop(self, entries: list[Entry]) -> list[int]:
        """Hand ``entries`` (least recently used first) to the tiers, if any, in one copy while
        their pages are still the index's, then drop the index's references (also when the
        demotion fails: its entries are then a later miss, never a lost page); returns their
        pages."""
        pages = [p for e in entries for p in e.pages]
        try:
            spans = [e for e in entries if not e.partial]  # tails are not demoted
            if self.tiers is not None and spans:
                data = self.read_pages([p for e in spans for p in e.pages])
                self.tiers.demote([e.digest for e in spans], data, self.pages_per_entry)
        finally:
            self.refs.mark(pages, False)
            self.refs.let_go(pages)
        return pages

    def clear(self) -> int:
        """Evict everything evictable (pages still mapped by sequences stay)."""
        return self.reclaim(self.refs.num_pages)

    def forget(self) -> int:
        """Drop every entry, also those whose pages sequences map (their K/V are about to be
        lost: a sleep that keeps nothing); with tiers, demoted first (least recently used
        first, one copy), so they can be promoted after. Returns the references dropped."""
        entries = sorted(self._entries.values(), key=lambda e: e.last_used)
        self._entries.clear()
        self._of_page.clear()
        if self.tails is not None:
            self.tails.clear()
        self._evictable.clear()
        self._lru.clear()
        self._whole_pages = 0
        pages = self._demote_and_drop(entries)
        self._stats.evicted_pages += len(pages)
        return len(pages)

    def references(self) -> list[int]:
        """Every page reference the index holds (for invariant checks)."""
        return [p for e in self._entries.values() for p in e.pages]

    def stats(self) -> PrefixStats:
        st = self._stats
        st.cached_pages = sum(len(e.pages) for e in self._entries.values())
        return PrefixStats(**vars(st))
