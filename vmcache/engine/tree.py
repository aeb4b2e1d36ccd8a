"""Token-tree verification by a fork per branch: a decoding sequence's extra draft chains are
verified in the same step as its main chain, each in a fork that shares every page of the
history copy-on-write (the page holding the branch point is copied on its first write), and
the branch the target agrees with longest wins: the sequence takes its page tables
(``cache.beams.assign``: remapped, no K/V copied), the losers are freed.

    history:  | p0 | p1 | p2 (t) |          shared by every branch (refcounts), nothing copied
    main:                  t d1 d2 d3       the sequence itself (its drafts appended)
    branch 1:              t e1 e2          a fork: p2 copied once (CoW), e1.. written after t
    branch 2:              t f1             another fork

Greedy requests only (a branch is chosen by the target's argmax). Touches the engine's cache
through its public calls (fork, truncate, can_grow, grow, assign, free) and nothing else.
"""

from __future__ import annotations

from vmcache.engine.speculative import verify
from vmcache.errors import CacheFull


def fork_branches(kv, seq) -> list[tuple[int, list[int]]]:
    """Forks of ``seq`` (its main chain scheduled whole this step), each grown over the
    pending token and one extra chain: [(slot, chain)]; a branch without room is dropped."""
    base, t = seq.cached, seq.tokens[seq.cached]
    out = []
    for chain in seq.branches:
        if not kv.num_free_slots:
            break
        (kid,) = kv.fork(seq.slot)
        kv.beams.truncate(kid, base)  # the main chain's positions are not this branch's
        try:
            if not kv.can_grow(kid, 1 + len(chain)):
                raise CacheFull("no room for a branch", wanted=1 + len(chain), free=0)
            kv.grow(kid, 1 + len(chain), token_ids=[t, *chain])
        except CacheFull:
            kv.free(kid)
            break
        out.append((kid, chain))
    seq.branches = []
    return out


def choose(kv, seq, rows, kids, kid_rows) -> tuple[int, int, int]:
    """After the step: the branch the target agrees with longest (ties: the main chain).
    ``seq`` takes a winning fork's tables and chain; every fork is freed. Returns (accepted,
    token, winner: 0 for the main chain, i for fork i)."""
    base = seq.cached
    main = seq.tokens[base + 1 : base + seq.chunk]
    best = (*verify(rows, main, 0, 0, seq.generator), 0)
    for i, ((_, chain), r) in enumerate(zip(kids, kid_rows), start=1):
        accepted, token = verify(r, chain, 0, 0, seq.generator)
        if accepted > best[0]:
            best = (accepted, token, i)
    if best[2]:
        kid, chain = kids[best[2] - 1]
        kv.beams.assign([seq.slot], [kid])  # its tables remapped to the fork's: no K/V copy
        seq.tokens[base + 1 :] = chain
        seq.chunk = 1 + len(chain)
    for kid, _ in kids:
        kv.free(kid)
    return best
