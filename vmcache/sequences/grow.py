"""Growing a sequence: the one allocation call, its query, and the pages mapped ahead.

    allocate(c, s, n, ids, ahead)   length += n and, when ``ahead`` > 0, pages for ``ahead``
                                    more tokens mapped now; an :class:`Allocation`, or None
                                    when the pool is short (nothing changed)
    can_grow(c, s, n)               the same plan, a pure query
    map_ahead(c, s, n)              only the pages mapped ahead (``allocate(s, 0, ahead=n)``)

A grow's plan (:class:`GrowPlan`) is built once per call: per group, the shared tail pages to
copy and the pages before and after; the sliding groups' pages their window gives back first.
Pages mapped ahead (vAttention maps the next step's pages while the current one computes; the
engine maps them after launching a step) belong to each
:class:`~vmcache.sequences.tables.PageTables` group, mapped and holding a pool reference but
outside the page table:

    table:    | p0 | p1 | p2 (tail) |            length → p2
    ahead:                           | r0 |       mapped at index 3, taken by the next grow

A grow takes them first; ``free``, ``assign``, ``truncate`` and ``swap.out`` give them back
first (``tx.drop_ahead``). Functions of the core ``c`` (:mod:`.core`): every change goes through
its transactional core (``c.tx``).
"""

from __future__ import annotations

import dataclasses

from vmcache.errors import CacheFull


@dataclasses.dataclass(frozen=True)
class Allocation:
    """What one :func:`allocate` did: ``pages`` taken from the pool for the grow (every table;
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


def allocate(c, s: int, n: int, token_ids, ahead: int) -> Allocation | GrowPlan:
    """Grow ``s`` (checked live) by ``n`` (checked) and map ``ahead`` tokens' pages past it:
    the :class:`Allocation`, or the plan that did not fit (nothing changed). A sliding group's
    release of pages its window no longer needs is made first, a change of its own."""
    if n == 0:
        return Allocation(0, 0, map_ahead(c, s, ahead) if ahead else 0)
    plan = plan_grow(c, s, n)  # a window release leaves it valid: it is all before the
    if not plan.fits:  # tail page the plan may copy
        return plan
    if plan.releases:
        c.tx.release_window(s, plan.releases)
    try:
        c.tx.grow(s, plan.groups)
    except CacheFull:  # a shared budget's pages went to another process first
        return plan
    c.seqs.grow(s, n, token_ids)
    c.changed()
    copied = sum(len(splits) for _, splits, _, _ in plan.groups)
    return Allocation(plan.need, copied, map_ahead(c, s, ahead) if ahead else 0)


def map_ahead(c, s: int, n: int) -> int:
    """Map now the pages a later ``grow(s, k ≤ n)`` would map; returns pages mapped (0 when
    the pool is short: nothing changed)."""
    n = min(n, c.config.max_seq_len - c.seqs.length(s))
    plan = []  # (group, first index not yet mapped, pages per table)
    for g in c.groups:
        first = g.num_pages(s) + len(g.ahead(s)[0])
        extra = g.pages_for(c.seqs.length(s) + n) - first
        if extra > 0:
            plan.append((g, first, extra))
    return c.tx.map_ahead(s, plan)


def mapped_pages(c, s: int) -> int:
    """Pages sequence ``s`` maps, every table: its tables' mapped pages (shared ones
    counted per sequence; released ones not) and the pages mapped ahead of it."""
    s = c.check_seq(s)
    return sum(len(g.ids) * (g.num_pages(s) - g.first(s)) + sum(map(len, g.ahead(s)))
               for g in c.groups)  # fmt: skip
