"""Growing a sequence, planned: what the one allocation call (``cache.allocate``, run by the
coordinator through its transactional core) will do, as pure functions of the core ``c``
(:mod:`.core`); nothing here changes anything.

    plan_grow(c, s, n)     a grow of ``s`` by ``n``: a :class:`GrowPlan`
    can_grow(c, s, n)      the same plan, as a query for schedulers
    ahead_plan(c, s, n)    the pages a later grow by up to ``n`` would map, to map them now
    mapped_pages(c, s)     pages ``s`` maps, every table, those mapped ahead included

A grow's plan is built once per call: per group, the shared tail pages to copy and the pages
before and after; the sliding groups' pages their window gives back first.
Pages mapped ahead (vAttention maps the next step's pages while the current one computes; the
engine maps them after launching a step) belong to each
:class:`~vmcache.sequences.tables.PageTables` group, mapped and holding a pool reference but
outside the page table:

    table:    | p0 | p1 | p2 (tail) |            length → p2
    ahead:                           | r0 |       mapped at index 3, taken by the next grow

A grow takes them first; ``free``, ``assign``, ``truncate`` and ``swap.out`` give them back
first (``tx.drop_ahead``).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What one ``cache.allocate`` did: ``pages`` taken from the pool for the grow (every table;
    ``copied`` of them copies of shared tail pages), ``ahead`` mapped past the new length."""

    pages: int
    copied: int
    ahead: int


@dataclasses.dataclass(frozen=True)
class GrowPlan:
    """A grow of ``s`` by ``n``, planned once. ``groups``: per group (group, shared tail pages
    to copy, pages now, pages after); ``releases``: (group, new first index, pages that leave)
    of each sliding group that gives pages back first; ``need`` pages the grow allocates and
    ``free`` pages it may take (available now plus what the releases return)."""

    groups: list
    releases: list
    need: int
    free: int

    @property
    def fits(self) -> bool:
        return self.need <= self.free


def group_plans(c, s: int, n: int) -> list:
    """Per group of ``grow(s, n)``: (group, shared tail pages to copy, pages now, pages
    after)."""
    length, rc = c.seqs.length(s), c.pool.refcounts
    return [(g, g.tail_splits(s, length, n, rc), g.num_pages(s), g.pages_for(length + n))
            for g in c.groups]  # fmt: skip


def plan_grow(c, s: int, n: int) -> GrowPlan:
    """The plan of ``grow(s, n)`` (``s`` checked live, ``n`` valid)."""
    length = c.seqs.length(s)
    groups = group_plans(c, s, n)
    releases = [(g, *p) for g in c.groups if g.sliding
                if (p := g.release_plan(s, length))[1]]  # fmt: skip
    back = [p for _, _, pages in releases for p in pages]
    free = c.pool.num_available + (c.pool.gain_from_decref(back) if back else 0)
    return GrowPlan(groups, releases, grow_need(s, groups), free)


def grow_need(s: int, groups) -> int:
    """Pages a grow with these per-group plans allocates: shared tail pages to copy and new
    pages not already mapped ahead, every table."""
    return sum(len(splits) + len(g.ids) * (p_new - p_old - min(len(g.ahead(s)[0]),
                                                                p_new - p_old))
               for g, splits, p_old, p_new in groups)  # fmt: skip


def can_grow(c, s: int, n: int) -> bool:
    """Whether ``grow(s, n)`` would succeed now (for schedulers; raises nothing for n)."""
    s = c.check_seq(s)
    if not isinstance(n, int) or n < 0 or c.seqs.length(s) + n > c.config.max_seq_len:
        return False
    return plan_grow(c, s, n).fits


def ahead_plan(c, s: int, n: int) -> list:
    """What mapping now the pages of a later ``grow(s, k ≤ n)`` takes: per group (group, first
    index not yet mapped, pages per table), for ``tx.map_ahead``."""
    n = min(n, c.config.max_seq_len - c.seqs.length(s))
    plan = []
    for g in c.groups:
        first = g.num_pages(s) + len(g.ahead(s)[0])
        extra = g.pages_for(c.seqs.length(s) + n) - first
        if extra > 0:
            plan.append((g, first, extra))
    return plan


def mapped_pages(c, s: int) -> int:
    """Pages sequence ``s`` maps, every table: its tables' mapped pages (shared ones
    counted per sequence; released ones not) and the pages mapped ahead of it."""
    s = c.check_seq(s)
    return sum(len(g.ids) * (g.num_pages(s) - g.first(s)) + sum(map(len, g.ahead(s)))
               for g in c.groups)  # fmt: skip
