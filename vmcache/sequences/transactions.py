"""The coordinator's transactional core: every change that allocates pages and maps them runs
here, all or nothing. Plan first; allocate every page (``CacheFull`` here changes nothing a
reader can see); run the fallible physical steps (copies, maps) with an undo log; then commit
bookkeeping that cannot fail.

    _split_pages(splits, s_ext, ext)   copy-on-write of shared pages (any sequences) and new
                                       pages mapped at the end of one sequence's tables
    _attach_row(s, tables, j0, rows)   one run of pages into several tables, or none

Touches: the pool (allocate, decref), the page-table groups (``replace``, ``extend``, read
``row``), the cache's physical hooks (``_attach``, ``_detach``, ``_copy_page``, ``_sync``),
and the coordinator's counters it owns (``_cow_copies``, ``_cow_bytes_copied``, ``_epoch``). It
reads lengths; it changes no length, slot, token id or salt.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

from vmcache.sequences.tables import PageTables


class Transactions:
    """Base of :class:`~vmcache.sequences.coordinator.SequenceCache` (its own machinery)."""

    def _split_pages(self, splits: list[tuple[int, int, int]], s_ext: int | None = None,
                     ext: list[tuple[PageTables, int, int]] = ()) -> None:  # fmt: skip
        """Copy-on-write ``splits`` (sequence, table, page index), possibly of several
        sequences, and map pages ``[j_from, j_to)`` into every table of each ``(group,
        j_from, j_to)`` of ``ext`` for ``s_ext``."""
        n_ext = sum(len(g.ids) * (j_to - j_from) for g, j_from, j_to in ext)
        fresh = self.pool.allocate(len(splits) + n_ext)
        undo: list[Callable[[], None]] = []
        replaced: list[tuple[int, int, int, int, int]] = []  # (seq, table, index, old, new)
        extension: list[tuple[PageTables, list[list[int]]]] = []
        if splits:
            self._sync()  # the old pages are unmapped below: no kernel may still read them
        try:
            it = iter(fresh)
            for s, t, j in splits:
                g = self._group_of[t]
                old, new = g.row(s, t)[j], next(it)
                self._copy_page(old, new, g.used_units(j, self._seqs.length(s)))
                self._detach(s, t, j, 1)
                undo.append(lambda s=s, t=t, j=j, old=old: self._attach(s, t, j, [old]))
                self._attach(s, t, j, [new])
                undo.append(lambda s=s, t=t, j=j: self._detach(s, t, j, 1))
                replaced.append((s, t, j, old, new))
            for g, j_from, j_to in ext:
                n = j_to - j_from
                rows = [list(islice(it, n)) for _ in g.ids]
                if n:
                    self._attach_row(s_ext, g.ids, j_from, rows)  # all tables or none
                    undo.append(lambda g=g, j=j_from, n=n: [self._detach(s_ext, t, j, n)
                                                            for t in g.ids])  # fmt: skip
                extension.append((g, rows))
        except BaseException:
            for f in reversed(undo):
                f()
            self.pool.decref(fresh)
            raise
        for s, t, j, _, new in replaced:
            g = self._group_of[t]
            g.replace(s, t, j, new)
            self._cow_bytes_copied += g.used_units(j, self._seqs.length(s)) * self.page_bytes // g.P
        self._cow_copies += len(replaced)
        self._epoch += 1
        self.pool.decref([old for *_, old, _ in replaced])
        for g, rows in extension:
            g.extend(s_ext, rows)

    def _attach_row(self, s: int, tables, j0: int, pages: list[list[int]]) -> None:
        """Map ``pages[i]`` at index ``j0`` of table ``tables[i]`` of ``s``: all or nothing."""
        done = 0
        try:
            for t, row in zip(tables, pages):
                self._attach(s, t, j0, row)
                done += 1
        except BaseException:
            for t, row in reversed(list(zip(tables, pages))[:done]):
                self._detach(s, t, j0, len(row))
            raise
