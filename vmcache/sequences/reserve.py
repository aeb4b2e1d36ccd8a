"""The core's questions about a grow and the pages mapped ahead of one (the
:class:`~vmcache.sequences.elastic.Elastic` facet's ``reserve`` maps them): what a grow would need
(``can_grow``), the pages a sequence maps, and giving reserved pages back before anything
moves a row. Reserved pages belong to each :class:`~vmcache.sequences.tables.PageTables` group:

    table:    | p0 | p1 | p2 (tail) |            length → p2
    reserved:                        | r0 |       mapped at index 3, taken by the next grow

``grow`` takes them first; ``free``, ``assign``, ``truncate`` and ``swap.out`` give them back
first. Functions of the coordinator ``c``: they read its lengths and groups, ask the pool,
and (``drop_reserved``) unmap through its hooks and decref.
"""

from __future__ import annotations


def can_grow(c, s: int, n: int) -> bool:
    """Whether ``grow(s, n)`` would succeed now (for schedulers; raises nothing for n)."""
    s = c._check_seq(s)
    if not isinstance(n, int) or n < 0 or c._seqs.length(s) + n > c.config.max_seq_len:
        return False
    plans, releases = c._grow_plan(s, n), c._release_plans(s)
    back = [p for _, _, pages in releases for p in pages]
    gain = c._pool.gain_from_decref(back) if back else 0
    return grow_need(c, s, plans) <= c._pool.num_available + gain


def grow_need(c, s: int, plans) -> int:
    """Pages a grow with these ``plans`` (:meth:`_grow_plan`) allocates: shared tail pages
    to copy and new pages not already reserved, every table."""
    return sum(len(splits) + len(g.ids) * (p_new - p_old - min(len(g.reserved(s)[0]),
                                                                p_new - p_old))
               for g, splits, p_old, p_new in plans)  # fmt: skip


def mapped_pages(c, s: int) -> int:
    """Pages sequence ``s`` maps, every table: its tables' mapped pages (shared ones
    counted per sequence; released ones not) and the pages reserved ahead of it."""
    s = c._check_seq(s)
    return sum(len(g.ids) * (g.num_pages(s) - g.first(s)) + sum(map(len, g.reserved(s)))
               for g in c._groups)  # fmt: skip


def drop_reserved(c, s: int) -> None:
    """Unmap and release the reserved pages of ``s`` (before anything moves its row)."""
    if not any(g.reserved(s)[0] for g in c._groups):
        return
    c._sync()
    for g in c._groups:
        first = g.num_pages(s)
        for t, have in zip(g.ids, g.reserved(s)):
            if have:
                c._detach(s, t, first, len(have))
        c._pool.decref(g.clear_reserved(s))
