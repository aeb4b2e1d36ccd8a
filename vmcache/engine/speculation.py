"""Speculative decoding as the engine sees it: one object it calls before scheduling
(:meth:`Speculation.propose`: drafts appended to every decoding sequence), after scheduling
(:meth:`~Speculation.drop_unscheduled`) and in postprocessing (:meth:`~Speculation.verify`:
the target's rows walk the drafts, the accepted path is kept, the rest rolled back), with its
own counters (:class:`SpeculationStats`). The drafters themselves and the sampling math are in
:mod:`vmcache.engine.drafts`; token trees' page work in :mod:`vmcache.engine.tree`.

    step k:    propose  →  schedule  →  run (every draft's logits)  →  verify → emit tokens
    seq.tokens: [... context | root | d1 d2 d3 ]      seq.cached = position of the root
                                     └ seq.draft = 3 ┘
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vmcache.engine import tree
from vmcache.engine.drafts import DraftModel, NgramDrafter, verify_tree
from vmcache.engine.request import Seq, Status


@dataclass
class SpeculationStats:
    """Written by :class:`Speculation` (and :func:`vmcache.engine.tree.fork_all`) only."""

    steps: int = 0  # sequence-steps that verified drafts
    proposed: int = 0  # draft tokens fed to the target
    accepted: int = 0  # of them, accepted
    rolled_back: int = 0  # rejected draft tokens whose K/V were truncated away
    mapped_pages: int = 0  # page-table entries verifications mapped (forks' included)
    tree_steps: int = 0  # verifications of a token tree (more than one chain)
    tree_branches: int = 0  # chains beyond the first that token trees verified
    tree_wins: int = 0  # tree verifications a chain other than the first won
    tree_copied_bytes: int = 0  # K/V bytes copied for trees: forks' CoW, or mask compaction

    @property
    def acceptance(self) -> float:
        return self.accepted / max(self.proposed, 1)


class Speculation:
    """A drafter (:class:`NgramDrafter` or :class:`DraftModel`) over the engine's cache."""

    def __init__(self, drafter: NgramDrafter | DraftModel, cache, vocab: int,
                 stats: SpeculationStats | None = None) -> None:  # fmt: skip
        if not isinstance(drafter, (NgramDrafter, DraftModel)):
            raise TypeError(f"speculative must be an NgramDrafter or a DraftModel, got "
                            f"{type(drafter).__name__}")  # fmt: skip
        if isinstance(drafter, DraftModel) and (drafter.vocab != vocab or drafter.kv is cache):
            raise ValueError(f"a draft model needs the target's vocabulary ({drafter.vocab} vs "
                             f"{vocab}) and its own cache")  # fmt: skip
        margin = cache.capacity.rollback_margin  # None: no sliding window
        if drafter.branches > 1 and margin is not None:
            raise ValueError("token trees (branches > 1) are not supported with sliding "
                             "windows: a branch forks back past the draft margin")  # fmt: skip
        if margin is not None and margin < drafter.k:
            raise ValueError(f"a sliding-window cache with rollback_tokens={margin} cannot "
                             f"take back a rejected draft of {drafter.k} tokens: build "
                             f"it with rollback_tokens >= {drafter.k}")  # fmt: skip
        self.drafter, self.kv = drafter, cache
        self.stats = stats if stats is not None else SpeculationStats()  # written here only

    def propose(self, running: list[Seq]) -> None:
        """Append draft tokens to every decoding sequence (``seq.draft`` of them): a chain,
        or a token tree (``seq.tree`` for the mask way, ``seq.branches`` for forks)."""
        drafter, items = self.drafter, []
        drafter.forget(running)
        for seq in running:
            if seq.generated and len(seq.pending) == 1 and not seq.draft:
                p = seq.req.params
                room = min(p.max_new_tokens - len(seq.generated) - 1,
                           self.kv.config.max_seq_len - len(seq.tokens))  # fmt: skip
                seq.spec_k = drafter.next_k(seq.spec_k, seq.spec_accepted)
                seq.mapped_at_draft = self.kv.capacity.mapped_pages(seq.slot)
                items.append((seq, min(room, seq.spec_k)))
        if drafter.branches == 1:
            for (seq, _), d in zip(items, drafter.draft(items)):
                seq.tokens += d
                seq.draft = len(d)
            return
        for seq, limit in items:  # one search: its first chain is the main draft
            chains = drafter.tree(seq.tokens, limit)
            if drafter.tree_mode == "fork" or len(chains) < 2:
                d, seq.branches = (chains[0] if chains else []), chains[1:]
            else:  # the whole tree in the sequence's range, if it fits there
                d, parents = tree.flatten(chains)
                if len(seq.tokens) + len(d) <= self.kv.config.max_seq_len:
                    seq.tree = parents
                else:
                    d = chains[0]
            seq.tokens += d
            seq.draft = len(d)

    def drop_unscheduled(self, running: list[Seq], batch: list[Seq]) -> None:
        """Drafts of sequences the scheduler left out of this step are dropped."""
        scheduled = {id(s) for s in batch}
        for seq in running:
            if seq.draft and id(seq) not in scheduled:
                seq.drop_draft()

    def fork_branches(self, batch: list[Seq], args, rows: list[int]) -> dict:
        """Token trees verified in forks: their chains join the step (see :mod:`tree`)."""
        return tree.fork_all(self.kv, self.stats, batch, args, rows)

    def finish(self, running: list[Seq]) -> None:
        """The run is over: a draft model's slots of sequences no longer running freed."""
        self.drafter.forget(running)

    def verify(self, seq: Seq, rows: torch.Tensor, forks,
               emit: Callable[[Seq, int, bool], None],
               rewind: Callable[[Seq, int], None]) -> None:  # fmt: skip
        """Walk ``seq``'s scheduled drafts (a chain or a tree; ``forks``: its branches' forks
        and rows) with the target's ``rows`` ``[drafts + 1, V]``, keep the accepted path
        (moved into place for a tree mask; a fork's tables taken), roll the rest back
        (truncate: pages past it unmapped, nothing copied; ``rewind(seq, cached)`` tells the
        scheduler how many tokens the cache now holds), and ``emit`` each accepted token
        and the one sampled after them (``emit(seq, token, already_in_tokens)``)."""
        st, p, kv = self.stats, seq.req.params, self.kv
        base = seq.cached  # the position of the token before the drafts
        nodes = seq.tokens[base : base + seq.chunk]  # root + the drafts this step fed
        parents = seq.tree[: seq.chunk] if seq.tree else list(range(-1, len(nodes) - 1))
        seq.tokens, seq.draft, seq.tree = seq.tokens[: base + seq.chunk], 0, None
        q = self.drafter.draft_probs(seq)
        q = None if q is None else [None, *q[: len(nodes) - 1]]
        owner, mapped = [0] * len(nodes), kv.capacity.mapped_pages(seq.slot)
        if forks:
            kids, kid_rows = forks
            mapped += sum(kv.capacity.mapped_pages(kid) for kid, _ in kids)
            nodes, parents, rows, owner = tree.with_forks(nodes, parents, rows, kids, kid_rows)
        path, token = verify_tree(rows, nodes, parents, p.temperature, p.top_k, seq.generator,
                                  q, p.top_p, p.min_p)  # fmt: skip
        accepted = len(path)
        seq.spec_accepted = accepted if len(nodes) > 1 else seq.spec_accepted
        chains = parents.count(0)  # chains hang from the root
        if chains > 1:
            st.tree_steps += 1
            st.tree_branches += 0 if forks else chains - 1  # forks: counted as they fork
        if forks:
            st.tree_wins += bool(tree.settle_forks(kv, seq, path, owner, forks[0]))
        elif path != list(range(1, accepted + 1)):  # off the first chain: move it into place
            st.tree_copied_bytes += kv.beams.compact(seq.slot, base + 1,
                                                     [base + j for j in path])  # fmt: skip
            st.tree_wins += 1
            seq.tokens[base + 1 : base + 1 + accepted] = [nodes[j] for j in path]
        keep = base + 1 + accepted
        if kv.seq_len(seq.slot) > keep:
            st.rolled_back += kv.seq_len(seq.slot) - keep
            kv.beams.truncate(seq.slot, keep)
        self.drafter.rolled_back(seq, keep)
        del seq.tokens[keep:]
        rewind(seq, keep)
        st.steps += 1
        st.mapped_pages += mapped - seq.mapped_at_draft
        st.proposed += len(nodes) - 1
        st.accepted += accepted
        for i in range(accepted):
            emit(seq, seq.tokens[base + 1 + i], True)
            if seq.status is Status.FINISHED:
                return
        emit(seq, token, False)
