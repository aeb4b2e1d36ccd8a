"""The coordinator's transactional core: the one writer of page tables and of refcounts.
Every change that maps, unmaps or shares pages runs here, all or nothing. Plan first; allocate
every page (``CacheFull`` here changes nothing a reader can see); run the fallible physical
steps (copies, maps) with an undo log; then commit bookkeeping that cannot fail.

    split_pages(splits, s_ext, ext)    copy-on-write of shared pages (any sequences) and new
                                       pages mapped at the end of one sequence's tables
    grow(s, groups)                    a grow's plan (:mod:`.grow`; run by the coordinator's
                                       allocate): pages mapped ahead taken first, then
                                       split_pages
    map_ahead(s, plan)                 pages mapped past a sequence's length, or none
    drop_ahead(s)                   those pages unmapped and given back
    release_window(s, releases)        pages wholly before a sliding window given back
    open(s) / close(s)                 a sequence's tables opened empty; every page dropped
    share(s, children)                 a fork: every page mapped into the children too
    share_rows(s, rows)                cached prefix pages mapped into a new sequence
    remap(plan, new, copies)           beams.assign: entries remapped, pages copied
    cut(s, length)                     pages past a length dropped
    adopt(s, firsts, length)           a hand-off's sequence mapped, its window released
    attach_row(s, tables, j0, rows)    one run of pages into several tables, or none
    map_steps(steps)                   the one undo log: runs mapped and unmapped, all or none

The prefix index holds page references of its own (cached pages outlive their sequence):
it states them through :class:`IndexRefs` (hold, let go, take fresh pages, mark indexed),
whose lines are here, so refcounts change in this module alone.

An object the coordinator holds (``cache._tx``), not a base class: it declares what it
touches. Touches: the pool (allocate, incref, decref), the page-table groups (every write
of theirs; the architecture test fails on another module that calls one), the cache's
physical hooks (``_attach``, ``_detach``, ``_copy_page``, ``_copy_pages``, ``_sync``), the
coordinator's epoch (through ``_changed``), and the counters it owns (``cow_copies``,
``cow_bytes_copied``, ``pages_mapped_ahead``). It reads lengths; it changes no length, slot,
token id or salt (``Slots`` does).
"""

from __future__ import annotations

from itertools import islice

from vmcache.errors import CacheFull
from vmcache.sequences.tables import RELEASED, PageTables


class Transactions:
    """The all-or-nothing changes of one :class:`~vmcache.sequences.coordinator.SequenceCache`."""

    def __init__(self, core) -> None:
        self._c = core
        self.cow_copies = 0  # pages copied on write since construction (owned here)
        self.cow_bytes_copied = 0  # bytes those copies moved (used part of each page only)
        self.pages_mapped_ahead = 0  # pages map_ahead mapped since construction (owned here)

    def count_copies(self, pages: int, nbytes: int) -> None:
        """``pages`` copied outside :meth:`split_pages` in place of a copy-on-write split
        (``beams.assign``'s tail copies), ``nbytes`` in all (their used parts)."""
        self.cow_copies += pages
        self.cow_bytes_copied += nbytes

    def split_pages(self, splits: list[tuple[int, int, int]], s_ext: int | None = None,
                     ext: list[tuple[PageTables, int, int]] = ()) -> None:  # fmt: skip
        """Copy-on-write ``splits`` (sequence, table, page index), possibly of several
        sequences, and map pages ``[j_from, j_to)`` into every table of each ``(group,
        j_from, j_to)`` of ``ext`` for ``s_ext``."""
        c = self._c
        n_ext = sum(len(g.ids) * (j_to - j_from) for g, j_from, j_to in ext)
        fresh = c.pool.allocate(len(splits) + n_ext)
        replaced: list[tuple[int, int, int, int, int]] = []  # (seq, table, index, old, new)
        extension: list[tuple[PageTables, list[list[int]]]] = []
        steps: list[tuple] = []
        if splits:
            c.sync()  # the old pages are unmapped below: no kernel may still read them
        try:
            it = iter(fresh)
            for s, t, j in splits:  # each shared page's bytes into its copy, then remapped
                g = c.group_of[t]
                old, new = g.row(s, t)[j], next(it)
                c.copy_page(old, new, g.used_units(j, c.seqs.length(s)))
                steps += [(s, t, j, [old], False), (s, t, j, [new], True)]
                replaced.append((s, t, j, old, new))
            for g, j_from, j_to in ext:
                n = j_to - j_from
                if not n:  # a grow within the pages it has
                    continue
                rows = [list(islice(it, n)) for _ in g.ids]
                steps += [(s_ext, t, j_from, row, True) for t, row in zip(g.ids, rows)]
                extension.append((g, rows))
            self.map_steps(steps)
        except BaseException:
            c.pool.decref(fresh)
            raise
        for s, t, j, _, new in replaced:
            g = c.group_of[t]
            g.replace_page(s, t, j, new)
            self.cow_bytes_copied += g.used_units(j, c.seqs.length(s)) * c.config.page_bytes // g.P
        self.cow_copies += len(replaced)
        c.changed()
        c.pool.decref([old for *_, old, _ in replaced])
        for g, rows in extension:
            g.append_pages(s_ext, rows)

    def grow(self, s: int, groups) -> None:
        """Map what a grow's per-group plan (group, tail splits, pages now, pages after) needs:
        the pages mapped ahead first, then copies of shared tail pages and new pages, all or
        nothing (``CacheFull`` changes nothing)."""
        takes = [g.take_ahead(s, p_new - p_old) for g, _, p_old, p_new in groups]
        try:
            self.split_pages([(s, t, j) for _, splits, _, _ in groups for t, j in splits], s,
                             [(g, p_old + k, p_new) for (g, _, p_old, p_new), k
                              in zip(groups, takes)])  # fmt: skip
        except BaseException:
            for (g, *_), k in zip(groups, takes):
                g.untake_ahead(s, k)
            raise

    def map_ahead(self, s: int, plan: list) -> int:
        """Map for ``s`` the pages of each (group, first index not yet mapped, pages per
        table) of ``plan`` and hold them past its length; returns pages mapped, 0 (nothing
        changed) when the pool is short."""
        c = self._c
        total = sum(len(g.ids) * extra for g, _, extra in plan)
        if not plan or not c.pool.can_allocate(total):
            return 0
        try:
            fresh = iter(c.pool.allocate(total))
        except CacheFull:  # a shared budget's pages went to another process first
            return 0
        rows = [[[next(fresh) for _ in range(extra)] for _ in g.ids] for g, _, extra in plan]
        try:
            self.map_steps([(s, t, first, row, True) for (g, first, _), r in zip(plan, rows)
                            for t, row in zip(g.ids, r)])  # fmt: skip
        except BaseException:
            c.pool.decref([p for r in rows for row in r for p in row])
            raise
        for (g, _, _), r in zip(plan, rows):
            g.add_ahead(s, r)
        self.pages_mapped_ahead += total
        return total

    def drop_ahead(self, s: int) -> None:
        """Unmap and give back the pages mapped ahead of ``s`` (before anything moves its
        row)."""
        c = self._c
        if not any(g.ahead(s)[0] for g in c.groups):
            return
        c.sync()
        for g in c.groups:
            first = g.num_pages(s)
            for t, have in zip(g.ids, g.ahead(s)):
                if have:
                    c.detach(s, t, first, len(have))
            c.pool.decref(g.clear_ahead(s))

    def release_window(self, s: int, releases) -> None:
        """Unmap and give back each (group, new first index, pages that leave) of
        ``releases``: the pages wholly before each sliding window (minus the rollback
        margin); the sequence's addresses and length stay."""
        c = self._c
        c.sync()  # no kernel may still read them
        for g, to, pages in releases:
            for t in g.ids:
                c.detach(s, t, g.first(s), to - g.first(s))
            g.release_front(s, to)
            c.pool.decref(pages)
        c.changed()

    def open(self, s: int) -> None:
        """Empty tables for new sequence ``s`` in every group (:meth:`share`, :meth:`adopt`
        and :meth:`share_rows` set the tables of the sequences they map)."""
        for g in self._c.groups:
            g.set_rows(s)

    def close(self, s: int) -> None:
        """Unmap every page of ``s`` and drop its references (pages at 0 go back to the pool);
        its tables closed. The pages mapped ahead are dropped first."""
        c = self._c
        self.drop_ahead(s)
        c.sync()
        dropped = []
        for g in c.groups:
            for t, j0, pages in g.mapped_runs(s):
                c.detach(s, t, j0, len(pages))
                dropped += pages
            g.drop_rows(s)
        c.pool.decref(dropped)

    def share(self, s: int, children: list[int]) -> None:
        """Map every page of ``s`` into each of ``children`` (new, empty slots), refcounts +=
        len(children), their tables a copy of its; all or nothing."""
        c = self._c
        runs = [r for g in c.groups for r in g.mapped_runs(s)]
        self.map_steps([(ch, t, j0, pages, True) for ch in children for t, j0, pages in runs])
        c.pool.incref([p for _, _, pages in runs for p in pages], len(children))
        for ch in children:
            for g in c.groups:
                g.set_rows(ch, g.rows(s), g.first(s))

    def share_rows(self, s: int, rows: list[list[int]]) -> None:
        """New sequence ``s`` of one group maps ``rows`` (cached pages, one list a table) from
        index 0, a reference each."""
        c = self._c
        (g,) = c.groups
        self.attach_row(s, g.ids, 0, rows)
        c.pool.incref([p for r in rows for p in r])
        g.set_rows(s, rows)

    def remap(self, plan: list, new: dict, copies: list) -> None:
        """``beams.assign``'s plan: per entry (dst, table, detach from, old pages, attach
        from, new pages), all unmapped and mapped or none; then the ``copies`` (source page,
        destination's own page, units, bytes), refcounts moved and each ``new[(dst, group
        index)] = (rows, first)`` the destination's tables."""
        c = self._c
        c.sync()
        self.map_steps(
            [(d, t, ja, old, False) for d, t, ja, old, _, _ in plan if old]
            + [(d, t, jb, nw, True) for d, t, _, _, jb, nw in plan if nw]
        )
        # after every mapping held (nothing left to undo), before any page is released
        c.copy_pages([(src, dst, units) for src, dst, units, _ in copies])
        self.count_copies(len(copies), sum(b for *_, b in copies))
        c.pool.incref([p for *_, nw in plan for p in nw])
        c.pool.decref([p for _, _, _, old, _, _ in plan for p in old])
        for (d, gi), (rows, first) in new.items():
            c.groups[gi].set_rows(d, rows, first)

    def cut(self, s: int, length: int) -> None:
        """Unmap and drop the pages of ``s`` past ``length`` tokens (the kept tail page
        stays); the pages mapped ahead first."""
        c = self._c
        self.drop_ahead(s)
        c.sync()
        dropped = []
        for g in c.groups:
            keep = g.pages_for(length)
            for t, j0, pages in g.mapped_runs(s):
                lo = max(keep, j0)
                if lo < j0 + len(pages):
                    c.detach(s, t, lo, j0 + len(pages) - lo)
            dropped += g.cut_rows(s, keep)
        c.pool.decref(dropped)

    def adopt(self, s: int, firsts: list[int], length: int) -> None:
        """Empty sequence ``s`` mapped for ``length`` tokens with each group's entries before
        ``firsts[i]`` released (a hand-off's window), all or nothing."""
        c = self._c
        ext = []
        for g, f in zip(c.groups, firsts):
            g.set_rows(s, [[RELEASED] * f for _ in g.ids], f)
            ext.append((g, f, g.pages_for(length)))
        self.split_pages([], s, ext)

    def attach_row(self, s: int, tables, j0: int, pages: list[list[int]]) -> None:
        """Map ``pages[i]`` at index ``j0`` of table ``tables[i]`` of ``s``: all or nothing."""
        self.map_steps([(s, t, j0, row, True) for t, row in zip(tables, pages)])

    def map_steps(self, steps: list[tuple]) -> None:
        """The cache's one undo log: run ``steps`` in order, all or none. A step ``(s, t, j0,
        pages, attach)`` maps ``pages`` at index ``j0`` of table ``t`` of ``s`` (``attach``)
        or unmaps the run of them there; on an error the steps done are undone in reverse
        (an unmapped run mapped back, a mapped one unmapped) and the error propagates."""
        c, done = self._c, []
        try:
            for step in steps:
                s, t, j0, pages, attach = step
                if attach:
                    c.attach(s, t, j0, pages)
                else:
                    c.detach(s, t, j0, len(pages))
                done.append(step)
        except BaseException:
            for s, t, j0, pages, attach in reversed(done):
                if attach:
                    c.detach(s, t, j0, len(pages))
                else:
                    c.attach(s, t, j0, pages)
            raise


class IndexRefs:
    """The prefix index's page references, as the index states them; their refcount writes
    are here (this module is the one writer of refcounts). Touches: the pool's refcounts and
    its indexed marks, for the pages the index names; reads its free count and size."""

    def __init__(self, pool) -> None:
        self._pool = pool  # the cache's pool (owned by the coordinator)

    @property
    def num_available(self) -> int:
        """Pages an allocation could take now (the pool's free ones, eviction included)."""
        return self._pool.num_available

    @property
    def num_pages(self) -> int:
        return self._pool.num_pages

    def take(self, n: int) -> list[int]:
        """``n`` fresh pages, each held once by the index (``CacheFull``: none taken)."""
        return self._pool.allocate(n)

    def hold(self, pages) -> None:
        """One more reference of the index's to each of ``pages``."""
        self._pool.incref(pages)

    def let_go(self, pages) -> None:
        """One reference of the index's to each of ``pages`` dropped (a page nobody holds
        goes back to the pool)."""
        self._pool.decref(pages)

    def mark(self, pages, indexed: bool) -> None:
        """``pages`` now held by an index entry (``indexed``) or no longer: the pool tells the
        index when such a page's refcount reaches or leaves 1 (it becomes evictable)."""
        self._pool.set_indexed(pages, indexed)
