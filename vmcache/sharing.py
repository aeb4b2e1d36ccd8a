"""Page-table rewiring without copying K/V: fork, assign (beam reorder), truncate (crop),
and write_group (one write for rows that hold the same tokens). Mixed into
:class:`~vmcache.seqcache.SequenceCache`, whose tables, lengths and hooks they use; refcounts
change only through the pool.

assign remaps only the entries that differ, so beams sharing a history keep their pages:

    before:  d = [a b c]      s = [a b x y]
    after:   d = [a b x y]    (c unmapped from d, x and y mapped into d; a, b untouched)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from .errors import CacheFull, check_int


class SharingOps:
    def _attach_row(self, s: int, j0: int, pages: list[list[int]]) -> None:
        """Map ``pages[t]`` at index ``j0`` of every table ``t`` of ``s``: all or nothing."""
        done = 0
        try:
            for t in range(self._T):
                self._attach(s, t, j0, pages[t])
                done += 1
        except BaseException:
            for t in reversed(range(done)):
                self._detach(s, t, j0, len(pages[t]))
            raise

    def fork(self, s: int, n: int = 1) -> list[int]:
        """``n`` children sharing every page of ``s`` (refcounts += n, no K/V copied)."""
        s = self._check_seq(s)
        check_int("n", n)
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        if n > len(self._free_slots):
            raise CacheFull(
                f"fork of {n} needs {n} free sequence slots, {len(self._free_slots)} free",
                wanted=n,
                free=len(self._free_slots),
            )
        tab = self._tables[s]
        children = [self._free_slots.pop() for _ in range(n)]
        undo: list[Callable[[], None]] = []
        try:
            for c in children:
                for t in range(self._T):
                    if tab[t]:
                        self._attach(c, t, 0, tab[t])
                        undo.append(lambda c=c, t=t: self._detach(c, t, 0, len(tab[t])))
        except BaseException:
            for f in reversed(undo):
                f()
            self._free_slots.extend(reversed(children))
            raise
        self.pool.incref([p for t in tab for p in t], n)
        for c in children:
            self._tables[c] = [list(t) for t in tab]
            self._set_len(c, self._lens[s])
            known = self._tokens[s]
            self._tokens[c], self._salts[c] = (
                (None if known is None else list(known)),
                self._salts[s],
            )
        return children

    def assign(self, dsts: Sequence[int], srcs: Sequence[int]) -> None:
        """Sequence ``dsts[i]`` becomes a copy-on-write copy of ``srcs[i]`` as it was before
        the call (beam search's reorder: a source may appear several times, and a sequence
        may be both a source and a destination). Nothing is copied; all or nothing."""
        dsts, srcs = list(dsts), list(srcs)
        if len(dsts) != len(srcs):
            raise ValueError(f"assign needs as many sources as destinations ({len(dsts)} vs "
                             f"{len(srcs)})")  # fmt: skip
        dsts = [self._check_seq(d) for d in dsts]
        srcs = [self._check_seq(s) for s in srcs]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"assign destinations must be distinct, got {dsts}")
        for d in dsts:
            self._drop_reserved(d)  # the rows are about to be remapped
        new = {d: [list(t) for t in self._tables[s]] for d, s in zip(dsts, srcs)}
        new_len = {d: self._lens[s] for d, s in zip(dsts, srcs)}
        new_ids = {d: (None if self._tokens[s] is None else list(self._tokens[s]),
                       self._salts[s]) for d, s in zip(dsts, srcs)}  # fmt: skip
        plan = []  # (dst, table, first differing index, old pages from there, new pages)
        for d in dsts:
            for t in range(self._T):
                old, nw = self._tables[d][t], new[d][t]
                j0 = 0
                while j0 < min(len(old), len(nw)) and old[j0] == nw[j0]:
                    j0 += 1
                if j0 < len(old) or j0 < len(nw):
                    plan.append((d, t, j0, old[j0:], nw[j0:]))
        self._sync()
        undo: list[Callable[[], None]] = []
        try:
            for d, t, j0, old, _ in plan:
                if old:
                    self._detach(d, t, j0, len(old))
                    undo.append(lambda d=d, t=t, j0=j0, old=old: self._attach(d, t, j0, old))
            for d, t, j0, _, nw in plan:
                if nw:
                    self._attach(d, t, j0, nw)
                    undo.append(lambda d=d, t=t, j0=j0, n=len(nw): self._detach(d, t, j0, n))
        except BaseException:
            for f in reversed(undo):
                f()
            raise
        self.pool.incref([p for *_, nw in plan for p in nw])
        self.pool.decref([p for _, _, _, old, _ in plan for p in old])
        for d in dsts:
            self._tables[d] = new[d]
            self._set_len(d, new_len[d])
            self._tokens[d], self._salts[d] = new_ids[d]

    def truncate(self, s: int, length: int) -> None:
        """Shorten sequence ``s`` to ``length`` tokens (``crop``): pages past it are unmapped
        and released; the kept tail page stays (copied on the next write if shared)."""
        s = self._check_seq(s)
        check_int("length", length)
        if not 0 <= length <= self._lens[s]:
            raise ValueError(f"truncate length must be in [0, {self._lens[s]}], got {length}")
        self._drop_reserved(s)
        keep = self._pages_for(length)
        tab = self._tables[s]
        self._sync()
        for t in range(self._T):
            if len(tab[t]) > keep:
                self._detach(s, t, keep, len(tab[t]) - keep)
        dropped = [p for t in tab for p in t[keep:]]
        for t in tab:
            del t[keep:]
        self.pool.decref(dropped)
        self._set_len(s, length)
        if self._tokens[s] is not None:
            del self._tokens[s][length:]

    def write_group(
        self, layer: int, seqs: Sequence[int], start: int, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """:meth:`write` the same ``k``, ``v`` into every sequence of ``seqs`` (e.g. a prompt
        repeated for beams and forked from one row). A page shared only within the group is
        written once, in place; a page also held outside the group is copied first."""
        seqs = list(seqs)
        if not seqs or len(set(seqs)) != len(seqs):
            raise ValueError(f"write_group needs distinct sequence ids, got {seqs}")
        layer, _, n = self._check_write(layer, seqs[0], start, k, v)
        for s in seqs[1:]:
            self._check_write(layer, s, start, k, v)
        if n == 0:
            return
        j_lo, j_hi = start * self._u // self._P, self._pages_for(start + n)
        tables = self._tables_of_layer(layer)

        def entries(s: int) -> list[tuple[int, int, int]]:
            tab = self._tables[s]
            return [(t, j, tab[t][j]) for t in tables for j in range(j_lo, j_hi)]

        uses = Counter(p for s in seqs for _, _, p in entries(s))
        # decided for every member before any split changes a refcount
        plan = {s: [(t, j) for t, j, p in entries(s) if self.pool.refcount(p) > uses[p]]
                for s in seqs}  # fmt: skip
        # every member's copies in one transaction: CacheFull or a driver error changes nothing
        self._split_pages([(s, t, j) for s, splits in plan.items() for t, j in splits])
        written: set[tuple[int, ...]] = set()
        for s in seqs:
            key = tuple(p for _, _, p in entries(s))
            if key not in written:
                written.add(key)
                self._store(layer, s, start, k, v)
