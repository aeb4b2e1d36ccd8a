"""Token trees: several draft chains per sequence, verified in one target step, built two ways.

The drafter's chains hang from the sequence's last token t. Both ways verify the same tree
(:func:`~vmcache.engine.drafts.verify_tree`: greedy, or rejection sampling that keeps the
target distribution) and differ in where the branches' K/V live:

**mask** (one sequence, a tree mask): every chain is appended to the sequence's own range in
topological order, each token embedded at its depth and attending to the history and its own
ancestors (``ModelRunner.step(trees=)``); the accepted path is moved into place
(``cache.beams.compact``: only tokens off the first chain are copied) and the rest truncated.

    range:    | history | t a1 a2 a3 b1 b2 c1 |      parents: [-1, 0, 1, 2, 0, 4, 0]
    b wins:   | history | t b1 b2 |                 b1, b2 copied two places left, rest cut

**fork** (a fork per branch): the first chain is the sequence's own; each extra chain is
verified in a fork that shares every page of the history copy-on-write (the page holding
the branch point is copied on its first write); a winning fork's tables are taken by
``cache.beams.assign`` (remapped, no K/V copied) and every fork is freed.

    history:  | p0 | p1 | p2 (t) |     shared by every branch (refcounts), nothing copied
    main:                  t a1 a2 a3
    fork 1:                t b1 b2    p2 copied once (CoW), b1.. written after t

Touches the engine's cache through its public calls (fork, truncate, compact, can_grow, grow,
assign, free, mapped_pages), the scheduled sequences' draft fields and the engine's tree
counters, and nothing else.
"""

from __future__ import annotations

import torch

from vmcache.errors import CacheFull

MODES = ("mask", "fork")


def flatten(chains: list[list[int]]) -> tuple[list[int], list[int]]:
    """The tree of ``chains`` (all hanging from the root) in topological order: (the draft
    tokens, the parents of root + drafts: −1 for the root, node indices after)."""
    tokens, parents = [], [-1]
    for chain in chains:
        for i, tok in enumerate(chain):
            parents.append(0 if i == 0 else len(tokens))
            tokens.append(tok)
    return tokens, parents


def fork_branches(kv, seq) -> list[tuple[int, list[int]]]:
    """Forks of ``seq`` (its main chain scheduled whole this step), each grown over the
    pending token and one extra chain: [(slot, chain)]; a branch without room is dropped."""
    base, t = seq.cached, seq.tokens[seq.cached]
    out = []
    for chain in seq.branches:
        if not kv.capacity.free_slots:
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


def fork_all(kv, stats, batch, args, rows) -> dict:
    """Forks for the extra chains of every scheduled token tree (fork way), appended to the
    step's ``args`` (slots, starts, tokens) and ``rows``; counted in the engine's ``stats``.
    Returns {batch index: (forks, their row indices, their row counts)}."""
    if not any(seq.branches for seq in batch):  # chains only: no fork, nothing to count
        return {}
    out, cow = {}, kv.stats().cow_bytes_copied
    for i, seq in enumerate(batch):
        if not seq.branches or seq.chunk != 1 + seq.draft:
            seq.branches = []
            continue
        forks = fork_branches(kv, seq)
        idx, counts = [], []
        for kid, chain in forks:
            idx.append(len(rows))
            counts.append(1 + len(chain))
            for a, x in zip(args, (kid, seq.cached, [seq.tokens[seq.cached], *chain])):
                a.append(x)
            rows.append(1 + len(chain))
        if forks:
            out[i] = (forks, idx, counts)
            stats.tree_branches += len(forks)
    stats.tree_copied_bytes += kv.stats().cow_bytes_copied - cow
    return out


def with_forks(nodes: list[int], parents: list[int], rows: torch.Tensor, kids, kid_rows):
    """The whole tree of a fork-verified sequence: its own chain (``nodes``: root + drafts,
    ``rows``) and each fork's chain with that fork's rows (row 0 of a fork, after the same
    history and t, is the root's again: left out). Returns (tokens, parents, rows, chain of
    each node: 0 for the main chain, i for fork i)."""
    nodes, parents, owner = list(nodes), list(parents), [0] * len(nodes)
    parts = [rows]
    for i, ((_, chain), r) in enumerate(zip(kids, kid_rows), start=1):
        for j, tok in enumerate(chain):
            parents.append(0 if j == 0 else len(nodes) - 1)
            nodes.append(tok)
            owner.append(i)
        parts.append(r[1:])
    return nodes, parents, torch.cat(parts), owner


def settle_forks(kv, seq, path: list[int], owner: list[int], kids) -> int:
    """After the walk: if the accepted path runs into fork i, ``seq`` takes its tables (no
    K/V copied) and chain; every fork is freed. Returns the winner (0: the main chain)."""
    win = owner[path[0]] if path else 0
    base = seq.cached
    if win:
        kid, chain = kids[win - 1]
        kv.beams.assign([seq.slot], [kid])
        seq.tokens[base + 1 :] = chain
    for kid, _ in kids:
        kv.free(kid)
    return win
