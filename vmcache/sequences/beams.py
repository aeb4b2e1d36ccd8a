"""Page-table rewiring, K/V copied only where a copy-on-write would copy them or a page would
only move: ``fork`` (a core call of the coordinator), and the :class:`Beams` facet
(``cache.beams``): assign (beam reorder), truncate (crop, a draft's rollback), compact (a token
tree's accepted path moved into place) and write_group (one write for rows that hold the same
tokens).

Touches, through the core it is handed (:mod:`.core`): its slots, lengths, token ids and salts
(read; ``assign`` and ``truncate`` set lengths, ids and salts of the sequences they change), its
page-table groups (read: plans), the pool's refcounts (read), the physical hooks ``store`` and
``load`` and the transactional core, which maps, refcounts and changes the tables (``tx.share``,
``tx.remap``, ``tx.cut``, ``tx.split_pages``). Nothing else.

assign remaps only the entries that differ, so beams sharing a history keep their pages:

    before:  d = [a b c]      s = [a b x y]
    after:   d = [a b x y]    (c unmapped from d, x and y mapped into d; a, b untouched)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from itertools import chain

import torch

from vmcache.errors import CacheFull, check_int


def fork(c, s: int, n: int = 1) -> list[int]:
    """``n`` children of coordinator ``c``'s sequence ``s`` sharing every page (refcounts
    += n, no K/V copied)."""
    s = c.check_seq(s)
    check_int("n", n)
    if n < 1:
        raise ValueError(f"fork needs n >= 1, got {n}")
    slots = c.seqs
    if n > slots.num_free:
        raise CacheFull(
            f"fork of {n} needs {n} free sequence slots, {slots.num_free} free",
            wanted=n,
            free=slots.num_free,
        )
    children = slots.take_many(n)
    try:
        c.tx.share(s, children)
    except BaseException:
        slots.untake(children)
        raise
    for ch in children:
        c.open(ch, slots.tokens(s), slots.salt(s), slots.length(s), tables=False)
    return children


class Beams:
    """``cache.beams``: rewiring a set of sequences' tables (K/V copied only in place of a
    copy-on-write split, see :meth:`assign`)."""

    def __init__(self, core) -> None:
        self._c = core

    def assign(self, dsts: Sequence[int], srcs: Sequence[int]) -> None:
        """Sequence ``dsts[i]`` becomes a copy-on-write copy of ``srcs[i]`` as it was before
        the call (beam search's reorder: a source may appear several times, and a sequence
        may be both a source and a destination); all or nothing.

        Pages that differ are remapped, except where the destination holds its own page
        alone (nothing else references it, no remap maps it elsewhere); the source's page is
        then copied into it:

        - at each table's tail, where the source's length ends inside a page a remap would
          leave shared: the destination's next write would split it again (a copy and a
          second remap), and the copy alone is what is left of both;
        - on VMKVCache (``_copies_moves``), at any page a remap would move (the source gives
          it up, so sharing saves nothing): a page copy costs less than an unmap and a map.
          A swap of two beams copies both ways, each source read before either is written.

            src s: [a b x y']   dst d: [a b c z]   (z: d's own tail, refcount 1)
            after: d = [a b x z ← y']   (c unmapped, x mapped in, page y' copied into z)
        """
        c = self._c
        dsts, srcs = list(dsts), list(srcs)
        if len(dsts) != len(srcs):
            raise ValueError(f"assign needs as many sources as destinations ({len(dsts)} vs "
                             f"{len(srcs)})")  # fmt: skip
        dsts = [c.check_seq(d) for d in dsts]
        srcs = [c.check_seq(s) for s in srcs]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"assign destinations must be distinct, got {dsts}")
        for d in dsts:
            c.tx.drop_ahead(d)  # the rows are about to be remapped
        new = {(d, gi): (g.rows(s), g.first(s)) for d, s in zip(dsts, srcs)
               for gi, g in enumerate(c.groups)}  # fmt: skip
        # (dst, table, detach from, old pages, attach from, new pages)
        plan = [(d, *step) for (d, gi), (rows, first) in new.items()
                for step in c.groups[gi].assign_plan(d, rows, first)]  # fmt: skip
        plan, copies = self._copies(plan, dict(zip(dsts, srcs)), new)
        c.tx.remap(plan, new, copies)
        c.seqs.copy_from(list(zip(dsts, srcs)))  # lengths, token ids, salts
        c.changed()

    def _copies(self, plan: list, src_of: dict, new: dict) -> tuple[list, list]:
        """``plan`` less the pages copied instead of remapped (see :meth:`assign`), and those
        copies: (source page, the destination's own page, units, bytes). ``new`` (the
        destinations' rows to be) is updated to keep the destination's pages there.

        A copy writes a page its destination holds alone, keeps it there and maps nothing:
        it is taken at a tail a remap would leave shared, and (``_copies_moves``) at any page a
        remap would move (its one holder afterwards: this destination). A page some remap left
        in the plan still maps elsewhere is never written: those copies fall back to remaps
        until none conflicts."""
        c = self._c
        # references each page would hold after a pure remap: a tail left with one holder
        # is moved, not copied (its new owner's write splits nothing)
        maps = Counter(chain.from_iterable(e[5] for e in plan))  # pages the plan maps
        after = maps.copy()
        after.subtract(chain.from_iterable(e[3] for e in plan))
        picked: dict[tuple[int, int], tuple[int, int]] = {}  # (plan entry, j) -> (theirs, mine)
        rc, group_of, moves = c.pool.refcounts, c.group_of, c.copies_moves
        length = {d: c.seqs.length(s) for d, s in src_of.items()}
        for i, (d, t, ja, old, jb, nw) in enumerate(plan):
            lo, hi = max(ja, jb), min(ja + len(old), jb + len(nw))
            if lo >= hi:  # only detaches or only attaches: no page to copy into
                continue
            g, n = group_of[t], length[d]
            tail = n * g.u // g.P if n * g.u % g.P else -1  # the page the next write lands in
            for j in range(lo, hi):
                mine, theirs = old[j - ja], nw[j - jb]
                if rc[mine] != 1:
                    continue
                holders = rc[theirs] + after[theirs]
                if j == tail == jb + len(nw) - 1 and holders >= 2:
                    after[theirs] -= 1
                elif not (moves and holders == 1):
                    continue
                picked[(i, j)] = (theirs, mine)
        while picked:  # a page a remaining remap maps must keep its bytes: no copy into it
            mapped = maps.copy()  # what the remaps left in the plan map: all less the copied
            mapped.subtract(theirs for theirs, _ in picked.values())
            clash = [key for key, (_, mine) in picked.items() if mapped[mine] > 0]
            if not clash:
                break
            for key in clash:
                del picked[key]
        at: dict[int, list[int]] = {}  # plan entry -> its copied pages j, ascending
        for i, j in sorted(picked):
            at.setdefault(i, []).append(j)
        kept, copies = [], []
        for i, (d, t, ja, old, jb, nw) in enumerate(plan):
            js = at.get(i)
            if not js:
                kept.append((d, t, ja, old, jb, nw))
                continue
            g = c.group_of[t]
            rows = new[(d, c.groups.index(g))][0][g.ids.index(t)]
            for j in js:
                theirs, mine = picked[(i, j)]
                # the whole page: what lies past the source's length must read as a remap
                # would show it (the source's bytes), never the destination's own older ones
                copies.append((theirs, mine, g.P, c.config.page_bytes))
                rows[j] = mine
            for lo, hi in _gaps(ja, ja + len(old), js):  # detach around the copied pages
                kept.append((d, t, lo, old[lo - ja : hi - ja], jb, []))
            for lo, hi in _gaps(jb, jb + len(nw), js):  # and attach around them
                kept.append((d, t, ja, [], lo, nw[lo - jb : hi - jb]))
        return kept, copies

    def truncate(self, s: int, length: int) -> None:
        """Shorten sequence ``s`` to ``length`` tokens (``crop``): pages past it are unmapped
        and released; the kept tail page stays (copied on the next write if shared). A
        sliding-window group can go back only as far as its rollback margin kept pages."""
        c = self._c
        s = c.check_seq(s)
        check_int("length", length)
        if not 0 <= length <= c.seqs.length(s):
            raise ValueError(f"truncate length must be in [0, {c.seqs.length(s)}], got "
                             f"{length}")  # fmt: skip
        self._check_margin(s, length)
        c.tx.cut(s, length)
        c.seqs.truncate(s, length)
        c.changed()

    def compact(self, s: int, start: int, picks: Sequence[int]) -> int:
        """Sequence ``s`` keeps, at positions ``start, start + 1, ...``, the tokens now at
        ``picks`` (strictly ascending, ``picks[i] >= start + i``), then is truncated to
        ``start + len(picks)``: a token tree's accepted path moved into place. Only tokens
        not already in place are copied (K/V of every layer and their token ids); returns the
        K/V bytes copied. Validated, and every shared page it writes copied (one transaction:
        ``CacheFull`` changes nothing), before any K/V moves.

            positions:  start  +1  +2  +3  +4          picks = [start, start+3, start+4]
            before:     t      a1  a2  b1  b2          (a tree: t → a1 → a2, t → b1 → b2)
            after:      t      b1  b2                  2 tokens copied, then truncated
        """
        c = self._c
        s = c.check_seq(s)
        check_int("start", start)
        picks = [check_int("picks entry", p) for p in picks]
        n = c.seqs.length(s)
        if not 0 <= start <= n or any(p < start + i for i, p in enumerate(picks)):
            raise ValueError(f"compact needs 0 <= start <= {n} and picks[i] >= start + i, "
                             f"got start {start}, picks {picks}")  # fmt: skip
        if any(b <= a for a, b in zip(picks, picks[1:])) or (picks and picks[-1] >= n):
            raise ValueError(f"compact picks must ascend strictly below {n}, got {picks}")
        moves = [i for i, p in enumerate(picks) if p != start + i]  # a suffix of the picks
        end = start + len(picks)
        if moves:
            self._check_margin(s, end)  # before any K/V moves
            dst = start + moves[0]
            splits = {x: None for layer in range(c.spec.num_layers)
                      for x in c.write_splits(layer, s, dst, end)}  # fmt: skip
            if splits:
                c.tx.split_pages(list(splits))
            src = torch.tensor([picks[i] for i in moves])
            for layer in range(c.spec.num_layers):  # stored bytes as they are: no requantizing
                k, v = c.load(layer, s, src)
                c.store(layer, s, dst, k, v)
            c.seqs.move_tokens(s, start + moves[0], [picks[i] for i in moves])
        self.truncate(s, end)
        return len(moves) * c.spec.bytes_per_token

    def _check_margin(self, s: int, length: int) -> None:
        """ValueError when a sliding window of ``s`` already released positions that a
        ``length``-token sequence still reads (past its rollback margin)."""
        for g in self._c.groups:
            if g.keep_page(length, 0) < g.first(s):
                raise ValueError(
                    f"truncate({s}, {length}): the sliding window of {g.window} tokens already "
                    f"released positions before {g.first_token(s)} that a {length}-token "
                    f"sequence still reads; raise rollback_tokens (now {g.rollback_tokens}) "
                    "to keep more"
                )

    def write_group(
        self, layer: int, seqs: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """:meth:`write` the same ``k``, ``v`` into every sequence of ``seqs`` (e.g. a prompt
        repeated for beams and forked from one row). A page shared only within the group is
        written once, in place; a page also held outside the group is copied first."""
        c = self._c
        seqs = list(seqs)
        if not seqs or len(set(seqs)) != len(seqs):
            raise ValueError(f"write_group needs distinct sequence ids, got {seqs}")
        layer, _, n = c.check_write(layer, seqs[0], start, k, v)
        for s in seqs[1:]:
            c.check_write(layer, s, start, k, v)
        if n == 0:
            return
        k, v = c.encode(layer, k, v)
        tables = c.tables_of_layer(layer)
        g = c.group_of[tables[0]]
        j_lo, j_hi = start * g.u // g.P, g.pages_for(start + n)

        def entries(s: int) -> list[tuple[int, int, int]]:
            return [(t, j, g.row(s, t)[j]) for t in tables for j in range(j_lo, j_hi)]

        uses = Counter(p for s in seqs for _, _, p in entries(s))
        # decided for every member before any split changes a refcount
        plan = {s: [(t, j) for t, j, p in entries(s) if c.pool.refcount(p) > uses[p]]
                for s in seqs}  # fmt: skip
        # every member's copies in one transaction: CacheFull or a driver error changes nothing
        c.tx.split_pages([(s, t, j) for s, splits in plan.items() for t, j in splits])
        written: set[tuple[int, ...]] = set()
        for s in seqs:
            key = tuple(p for _, _, p in entries(s))
            if key not in written:
                written.add(key)
                c.store(layer, s, start, k, v)


def _gaps(lo: int, hi: int, cut: list[int]) -> list[tuple[int, int]]:
    """The runs of ``range(lo, hi)`` between the positions ``cut`` (ascending, distinct, each
    in ``[lo, hi)``)."""
    runs, start = [], lo
    for j in cut:
        if start < j:
            runs.append((start, j))
        start = j + 1
    if start < hi:
        runs.append((start, hi))
    return runs
