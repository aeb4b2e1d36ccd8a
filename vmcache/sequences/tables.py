"""PageTables: the page tables of one attention type. A cache holds one per type under the
sequence coordinator (:class:`~vmcache.sequences.coordinator.SequenceCache`), as vLLM v1 holds one
single-type manager per KV-cache group under its coordinator.

A group owns the tables ``ids`` (the cache's table numbers: VMKVCache ``layer_major``, the K
and V tensors of its layers; ``token_major``, its one K and one V tensor; PagedKVCache, its
block table). For every live sequence it keeps one page list per table, all as long as the
sequence's length needs, and the pages mapped ahead of them. Page ``j`` covers units
``[j·P, (j+1)·P)`` of a row, a token is ``u`` units.

A sliding-window group (window W, rollback margin k) drops the pages that lie wholly before
the first token a later step can read: the next query (position L, the current length)
reads keys (L − W, L], and a ``truncate`` back by up to k tokens must stay possible. An
attention kernel may read more than that: FlashAttention loads a window's K in whole tiles of
kBlockN tokens (64 or 128 on sm_90) from a tile-aligned start, up to kBlockN − 1 tokens before
the window, so with ``align_tokens`` A (a multiple of every kBlockN: 256 on CUDA) the first
kept token is rounded down to a multiple of A (at most one more 2 MiB page per table):

    keep from token  f = ⌊max(0, L − W + 1 − k) / A⌋·A     released: pages j < ⌊f·u / P⌋
    table:  | RELEASED | RELEASED | p2 | p3 | p4 (tail) |
            0          1          ^ first mapped page, the same in every table of the group

Released entries stay in the lists as ``RELEASED``, so page ``j`` is index ``j`` and a
sequence's virtual addresses never move. A full-attention group never releases.

Owned here: the page lists, the released counts, the pages mapped ahead. Their writes (the
methods under "changes") are called by the transactional core alone
(:mod:`vmcache.sequences.transactions`; the architecture test parses the package for it).
Nothing here maps memory or changes a refcount: the core does both (the cache's hooks and the
pool) and then commits here, in that order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import itemgetter

RELEASED = -1  # a page-list entry whose page went back to the pool (sliding window)
FA_TILE_TOKENS = 256  # a multiple of every FlashAttention K tile (kBlockN 64 / 128 on sm_90)


class PageTables:
    def __init__(
        self,
        ids: Sequence[int],
        window: int | None,
        max_seqs: int,
        units_per_token: int,
        units_per_page: int,
        rollback_tokens: int = 0,
        align_tokens: int = 1,
    ) -> None:
        self.ids = tuple(ids)  # the cache's table numbers this group owns
        self.window = window  # None: full attention
        self.align_tokens = align_tokens  # the first kept token is a multiple of this
        self.rollback_tokens = rollback_tokens  # a truncate back by this much stays possible
        self.u, self.P = units_per_token, units_per_page
        self._pos = {t: i for i, t in enumerate(self.ids)}
        self._rows: list[list[list[int]] | None] = [None] * max_seqs  # s -> a list per table
        self._first = [0] * max_seqs  # s -> leading pages released (every table alike)
        self._ahead: list[list[list[int]]] = [[[] for _ in self.ids] for _ in range(max_seqs)]
        self.released_pages = 0  # page-table entries released by the window so far

    # --- queries -----------------------------------------------------------------------
    @property
    def sliding(self) -> bool:
        return self.window is not None

    def pages_for(self, length: int) -> int:
        """Entries a table of a ``length``-token sequence has (released ones included)."""
        return -(-length * self.u // self.P)

    def used_units(self, j: int, length: int) -> int:
        return max(0, min(self.P, length * self.u - j * self.P))

    def row(self, s: int, t: int) -> list[int]:
        """Table ``t`` of sequence ``s`` (read only; RELEASED entries in front)."""
        return self._rows[s][self._pos[t]]

    def rows(self, s: int) -> list[list[int]]:
        """A copy of every table of ``s``, in ``ids`` order."""
        return [list(r) for r in self._rows[s]]

    def first(self, s: int) -> int:
        """Leading entries of ``s``'s tables released by the window (0 for full attention)."""
        return self._first[s]

    def num_pages(self, s: int) -> int:
        """Entries in each of ``s``'s tables (released ones included)."""
        return len(self._rows[s][0])

    def mapped_runs(self, s: int) -> Iterator[tuple[int, int, list[int]]]:
        """(table, first index, pages) of the mapped part of each table."""
        f = self._first[s]
        return ((t, f, r[f:]) for t, r in zip(self.ids, self._rows[s]) if len(r) > f)

    def ahead(self, s: int) -> list[list[int]]:
        return self._ahead[s]

    def first_token(self, s: int) -> int:
        """The first position of ``s`` whose K/V are wholly mapped (0 unless released)."""
        return self.token_at(self._first[s])

    def first_token_after_grow(self, s: int, length: int) -> int:
        """:meth:`first_token` once the next grow of ``s`` (now ``length`` tokens long) has
        run its release."""
        return self.token_at(self.release_plan(s, length)[0])

    def token_at(self, j: int) -> int:
        """The first token wholly inside page ``j`` and after (a page may start mid-token)."""
        return -(-j * self.P // self.u)

    def keep_page(self, length: int, margin: int) -> int:
        """The first page a ``length``-token sequence must keep mapped when a truncate back
        by ``margin`` tokens must stay possible (0 for full attention)."""
        if self.window is None:
            return 0
        f = max(0, length - self.window + 1 - margin)
        return (f - f % self.align_tokens) * self.u // self.P

    def release_plan(self, s: int, length: int) -> tuple[int, list[int]]:
        """(new first index, the pages that leave) when ``s`` of ``length`` tokens drops what
        its window no longer needs; nothing leaves when the index does not move."""
        to = min(self.keep_page(length, self.rollback_tokens), self.num_pages(s))
        f = self._first[s]
        if to <= f:
            return f, []
        return to, [p for r in self._rows[s] for p in r[f:to]]

    def splits(self, s: int, tables: Sequence[int], j_lo: int, j_hi: int,
               refcounts: Sequence[int]) -> list:  # fmt: skip
        """(table, index) of the mapped pages in ``[j_lo, j_hi)`` of ``tables`` that another
        holder shares (``refcounts[page]`` > 1, the pool's): a write there copies them first."""
        rows, lo = self._rows[s], max(j_lo, self._first[s])
        mine = (zip(tables, rows) if tables is self.ids
                else ((t, rows[self._pos[t]]) for t in tables))  # fmt: skip
        if j_hi - lo == 1:  # one page per table (a grow's tail): the common case
            if tables is self.ids:  # every table as long as the others: one pass in C first
                if not rows or lo >= len(rows[0]):
                    return []
                if max(map(refcounts.__getitem__, map(itemgetter(lo), rows))) <= 1:
                    return []  # nothing shared at the tail
            return [(t, lo) for t, r in mine if lo < len(r) and refcounts[r[lo]] > 1]
        return [(t, j) for t, r in mine for j in range(lo, min(j_hi, len(r)))
                if refcounts[r[j]] > 1]  # fmt: skip

    def tail_splits(self, s: int, length: int, n: int,
                    refcounts: Sequence[int]) -> list[tuple[int, int]]:  # fmt: skip
        """The shared tail pages a grow by ``n`` writes into (copied first)."""
        if n <= 0 or not (length * self.u) % self.P:
            return []
        p = self.pages_for(length)
        return self.splits(s, self.ids, p - 1, p, refcounts)

    def assign_plan(self, d: int, rows: list[list[int]], first: int) -> list[tuple]:
        """What changes when ``d``'s tables become ``rows`` (released up to ``first``):
        (table, j_detach, old pages there, j_attach, new pages there) per table that differs;
        entries equal in both (shared history) stay mapped."""
        plan, j0 = [], 0
        f_old = self._first[d]
        for t, old, new in zip(self.ids, self._rows[d], rows):
            if old == new:
                continue
            j0 = _common_prefix(old, new, j0)  # tables mostly part where the last one did
            a, b = max(j0, f_old), max(j0, first)
            plan.append((t, a, old[a:], b, new[b:]))
        return plan

    # --- changes (after the coordinator mapped and refcounted) --------------------------
    def set_rows(self, s: int, rows: list[list[int]] | None = None, first: int = 0) -> None:
        """``s``'s tables from now on: empty, or ``rows``, whose lists the group takes over
        (a caller hands in lists nothing else holds, e.g. what :meth:`rows` returned)."""
        self._rows[s] = [[] for _ in self.ids] if rows is None else rows
        self._first[s] = first

    def drop_rows(self, s: int) -> None:
        self._rows[s] = None
        self._first[s] = 0

    def replace_page(self, s: int, t: int, j: int, page: int) -> None:
        self._rows[s][self._pos[t]][j] = page

    def append_pages(self, s: int, pages: list[list[int]]) -> None:
        """Append ``pages[i]`` (as many for every table) to table ``i`` of ``s``."""
        for r, new in zip(self._rows[s], pages):
            r.extend(new)

    def cut_rows(self, s: int, keep: int) -> list[int]:
        """Drop the entries past ``keep``; returns the mapped pages among them."""
        f = self._first[s]
        out = [p for r in self._rows[s] for p in r[max(keep, f) :]]
        for r in self._rows[s]:
            del r[keep:]
        return out

    def release_front(self, s: int, to: int) -> None:
        """Mark entries ``[first, to)`` released (their pages were unmapped and dropped)."""
        f = self._first[s]
        for r in self._rows[s]:
            r[f:to] = [RELEASED] * (to - f)
        self.released_pages += len(self.ids) * (to - f)
        self._first[s] = to

    def take_ahead(self, s: int, pages: int) -> int:
        """Move up to ``pages`` reserved pages per table into the tables (they are mapped at
        the right indices already); returns how many per table."""
        have = self._ahead[s]
        take = min(len(have[0]), pages)
        if take <= 0:  # nothing reserved, or nothing asked (a grow within its pages)
            return 0
        for r, a in zip(self._rows[s], have):
            r.extend(a[:take])
            del a[:take]
        return take

    def untake_ahead(self, s: int, take: int) -> None:
        for r, a in zip(self._rows[s], self._ahead[s]):
            a[:0] = r[len(r) - take :]
            del r[len(r) - take :]

    def add_ahead(self, s: int, pages: list[list[int]]) -> None:
        for a, new in zip(self._ahead[s], pages):
            a.extend(new)

    def clear_ahead(self, s: int) -> list[int]:
        out = [p for a in self._ahead[s] for p in a]
        for a in self._ahead[s]:
            a.clear()
        return out


def _common_prefix(a: list[int], b: list[int], guess: int = 0) -> int:
    """The length of the longest common prefix of ``a`` and ``b``: ``guess`` when it is (one
    comparison of slices), else a binary search over prefix equality (monotone), each probe
    one comparison of slices (a beam's tables share all but their last pages: a loop over
    every entry was most of a sizing run's time)."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1] past hi
    if 0 < guess < hi and a[guess] != b[guess] and a[:guess] == b[:guess]:
        return guess
    if a[:hi] == b[:hi]:
        return hi
    hi -= 1  # the prefix of length hi differs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
