"""Drafts for speculative decoding (the engine's stage around them is :mod:`.speculation`):
draft a few tokens per decoding sequence, verify them all in the next target step (packed with
the other sequences' prefills and decodes), keep the longest accepted run plus one token of the
target's own, and roll the rejected ones back (``cache.beams.truncate``: the pages past the new
length unmapped and returned, nothing copied).

    tokens:   ... t  | d1 d2 d3        a step feeds t and the drafts (4 positions, one step)
    logits:          | r0 r1 r2 r3     r_i: the target's next-token logits after position i
    verify:   r0 → d1 ✓, r1 → d2 ✓, r2 → x ≠ d3: keep t d1 d2, emit x, truncate d3's K/V

Greedy (temperature 0) emits exactly the tokens the target alone would. With temperature > 0
a draft ``d`` is accepted with probability ``p(d)`` (the draft is a point mass: min(1, p/q) with
q(d) = 1), and a rejection samples from ``p`` with ``d`` removed and renormalised, so every
emitted token follows the target distribution (Leviathan et al., 2023; Chen et al., 2023).

:class:`NgramDrafter` is prompt lookup (no second model): the longest suffix n-gram of the
sequence seen earlier in it proposes what followed there. Useful where answers quote their
input (summaries, code edits, retrieval-grounded answers); elsewhere it proposes little.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafts: up to ``k`` tokens that followed the last occurrence of the
    sequence's longest suffix of ``min_ngram`` to ``max_ngram`` tokens."""

    k: int = 4
    max_ngram: int = 3
    min_ngram: int = 1
    adaptive: bool = True  # per sequence: propose one more than its last step accepted
    branches: int = 1  # > 1: a token tree of up to this many chains
    tree_mode: str = "mask"  # how a tree is verified (vmcache/engine/tree.py): "mask" | "fork"

    def next_k(self, last_k: int | None, accepted: int | None) -> int:
        """How many drafts a sequence proposes next: ``k`` at first; with ``adaptive``, one
        more than it accepted last time (all accepted: grow by one, up to ``k``), so a
        sequence whose drafts keep failing feeds the target little extra work."""
        if not self.adaptive or last_k is None or accepted is None:
            return self.k
        return max(1, min(self.k, accepted + 1))

    def __post_init__(self) -> None:
        for name in ("k", "max_ngram", "min_ngram", "branches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {self.min_ngram} exceeds max_ngram {self.max_ngram}")
        if self.tree_mode not in ("mask", "fork"):
            raise ValueError(f"tree_mode must be 'mask' or 'fork', got {self.tree_mode!r}")

    def draft(self, items) -> list[list[int]]:
        """Drafts for ``items`` ((sequence, most drafts), in order)."""
        return [self.propose(seq.tokens, limit) for seq, limit in items]

    def tree(self, tokens: list[int], limit: int) -> list[list[int]]:
        """Up to ``branches`` chains of at most ``limit`` drafts that differ in their first
        token: what followed the latest occurrences of the longest matching suffix n-gram
        (the first is :meth:`propose`'s)."""
        return self._chains(tokens, limit, self.branches)

    def forget(self, running) -> None:
        """Nothing to free (no state per sequence)."""

    def draft_probs(self, seq) -> None:
        """Prompt-lookup drafts are point masses: no distribution to verify against."""

    def rolled_back(self, seq, keep: int) -> None:
        """Nothing to undo (no state per sequence)."""

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """At most ``min(k, limit)`` draft tokens to follow ``tokens`` (maybe none)."""
        chains = self._chains(tokens, limit, 1)
        return chains[0] if chains else []

    def _chains(self, tokens: list[int], limit: int, most: int) -> list[list[int]]:
        """Up to ``most`` chains (distinct first tokens) of at most ``min(k, limit)`` tokens
        that followed the latest earlier occurrences of the longest suffix n-gram found."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        n_tokens, chains, firsts = len(tokens), [], set()
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            suffix = tokens[n_tokens - n :]
            for start in range(n_tokens - n - 1, -1, -1):  # the latest occurrence first
                if tokens[start : start + n] == suffix:
                    follow = tokens[start + n : start + n + limit]
                    if follow and follow[0] not in firsts:
                        firsts.add(follow[0])
                        chains.append(follow)
                        if len(chains) == most:
                            return chains
            if chains:
                return chains
        return chains


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float = 1.0,
                 min_p: float = 0.0) -> torch.Tensor:  # fmt: skip
    """The distribution the engine samples from (``temperature > 0``): fp32 CPU ``[V]``.
    Filters in transformers' order: temperature, then ``top_k`` (0: off), then ``top_p``
    (the smallest set of most likely tokens whose mass reaches it; 1: off), then ``min_p``
    (tokens below ``min_p`` times the most likely one's probability dropped; 0: off). The
    most likely token always stays."""
    logits = logits.float().cpu() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(0) - sorted_p  # mass of the more likely tokens
        drop = torch.zeros_like(probs, dtype=torch.bool)
        drop[order] = before >= top_p
        probs = probs.masked_fill(drop, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator,
           top_p: float = 1.0, min_p: float = 0.0) -> int:  # fmt: skip
    """The engine's next token from ``logits`` ``[V]``: argmax at temperature 0, else drawn
    from :func:`target_probs` with the sequence's ``generator``."""
    if temperature == 0:
        return int(logits.argmax())
    probs = target_probs(logits, temperature, top_k, top_p, min_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def verify(rows: torch.Tensor, drafts: list[int], temperature: float, top_k: int,
           generator: torch.Generator, draft_probs: torch.Tensor | None = None,
           top_p: float = 1.0, min_p: float = 0.0) -> tuple[int, int]:  # fmt: skip
    """(drafts accepted, the token emitted after them) from the target's logits ``rows``
    ``[len(drafts) + 1, V]`` (row i: after the position before draft i). ``draft_probs``
    ``[len(drafts), V]``: the distributions the drafts were sampled from (a sampling draft
    model); None: each draft is a point mass (prompt lookup, greedy drafts)."""
    parents = list(range(-1, len(drafts)))
    q = None if draft_probs is None else [None, *draft_probs]
    path, token = verify_tree(rows, [-1, *drafts], parents, temperature, top_k, generator, q,
                              top_p, min_p)  # fmt: skip
    return len(path), token


def verify_tree(rows: torch.Tensor, tokens: list[int], parents: list[int], temperature: float,
                top_k: int, generator: torch.Generator, draft_probs=None, top_p: float = 1.0,
                min_p: float = 0.0) -> tuple[list[int], int]:  # fmt: skip
    """Walk a token tree from its root: (the accepted nodes, root excluded, in order; the
    token emitted after the last). ``tokens[j]``, ``parents[j]``: node j (node 0 the root,
    the sequence's last token, parent −1; parents before children); ``rows[j]`` ``[V]``: the
    target's logits after node j. ``draft_probs[j]``: the distribution node j was sampled
    from, or None (a point mass).

    Greedy: descend to the child holding the target's argmax while one does. Sampling
    (SpecInfer's multi-round rejection, Miao et al., 2024): the children are tried in order,
    each accepted with probability min(1, p(d)/q(d)); after a rejection p becomes the
    residual max(0, p − q) renormalised (a point mass: d's probability removed), and when
    every child is rejected the token is drawn from the residual. Each emitted token then
    follows the target's distribution exactly, whatever the drafts.

        node:    0(t) ─ 1 ─ 2          rows[0] picks among {1, 3}; rows[1] among {2}
                   └─── 3
    """
    kids: list[list[int]] = [[] for _ in tokens]
    for j, p in enumerate(parents[1:], start=1):
        kids[p].append(j)
    path, node = [], 0
    while True:
        if temperature == 0:
            t = int(rows[node].argmax())
            nxt = next((c for c in kids[node] if tokens[c] == t), None)
            if nxt is None:
                return path, t
        else:
            p, nxt = target_probs(rows[node], temperature, top_k, top_p, min_p), None
            for c in kids[node]:
                d = tokens[c]
                q = None if draft_probs is None else draft_probs[c]
                ratio = float(p[d]) if q is None else min(1.0, float(p[d] / q[d]))
                if float(torch.rand((), generator=generator)) < ratio:
                    nxt = c
                    break
                if q is None:
                    p[d] = 0.0
                else:
                    p = (p - q.float().cpu()).clamp_(min=0)
                p = (p / p.sum() if float(p.sum()) > 0 else
                     target_probs(rows[node], temperature, top_k, top_p, min_p))  # fmt: skip
            if nxt is None:
                return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(nxt)
        node = nxt


class DraftModel:
    """Drafts from a smaller model run on its own cache (the same cache class, its own pool):
    for every decoding sequence the draft cache catches up on the tokens it has not seen, then
    ``k`` steps, all sequences batched in each: greedy for greedy requests; for sampled ones
    each draft is drawn from the draft model's own distribution at the request's temperature
    and top-k (kept, :meth:`draft_probs`, so :func:`verify` accepts with min(1, p/q) and keeps
    the target distribution). After a verification the draft cache is truncated to the
    accepted length (its K/V past it are of rejected drafts). A draft cache without room
    proposes nothing for that sequence; it never fails a step."""

    branches = 1  # chains only: a draft model proposes no token tree

    def __init__(self, model, cache, k: int = 4, adaptive: bool = True) -> None:
        from vmcache.engine.runner import ModelRunner

        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.k, self.adaptive = k, adaptive
        self.kv = cache
        self.runner = ModelRunner(model, cache)
        self.vocab = model.config.get_text_config().vocab_size
        self._slots: dict[int, tuple[object, int]] = {}  # id(seq) -> (seq, draft slot)
        self._lens: dict[int, int] = {}  # id(seq) -> tokens whose K/V the draft cache holds
        self._q: dict[int, list[torch.Tensor]] = {}  # id(seq) -> its sampled drafts' q rows

    next_k = NgramDrafter.next_k

    def forget(self, running) -> None:
        """Free the draft slots of sequences no longer running (finished, preempted)."""
        live = {id(s) for s in running}
        for key in [k for k in self._slots if k not in live]:
            self.kv.free(self._slots.pop(key)[1])
            self._lens.pop(key)
        self._q = {k: q for k, q in self._q.items() if k in live}

    def draft_probs(self, seq) -> torch.Tensor | None:
        """``[drafts, V]``: the distributions ``seq``'s current drafts were sampled from
        (None for a greedy request: its drafts are point masses)."""
        q = self._q.get(id(seq))
        return None if not q else torch.stack(q)

    def rolled_back(self, seq, keep: int) -> None:
        """The target kept ``seq.tokens[:keep]``: draft K/V past it are of rejected drafts."""
        key = id(seq)
        self._q.pop(key, None)
        if key in self._slots and self._lens[key] > keep:
            self.kv.beams.truncate(self._slots[key][1], keep)
            self._lens[key] = keep

    def draft(self, items) -> list[list[int]]:
        """Drafts for ``items`` ((sequence, most drafts), in order)."""
        out: list[list[int]] = [[] for _ in items]
        for seq, _ in items:
            self._q.pop(id(seq), None)
        work = []  # (index in items, seq, slot, limit)
        for i, (seq, limit) in enumerate(items):
            if limit <= 0:
                continue
            slot = self._slot(seq)
            if slot is not None:
                work.append((i, seq, slot, limit))
        # catch up: every token the draft cache has not seen, in one batched step
        feeds = []
        for i, seq, slot, limit in work:
            have = self._lens[id(seq)]
            chunk = seq.tokens[have:]
            if not self._grow(seq, slot, len(chunk)):
                continue
            feeds.append((i, seq, slot, limit, have, chunk))
        if not feeds:
            return out
        logits = self.runner.step([f[2] for f in feeds], [f[4] for f in feeds],
                                  [f[5] for f in feeds])  # fmt: skip
        active = []
        for row, (i, seq, slot, limit, have, chunk) in zip(logits, feeds):
            self._lens[id(seq)] = have + len(chunk)
            out[i].append(self._pick(seq, row))
            active.append((i, seq, slot, limit))
        for _ in range(1, max(f[3] for f in active)):  # greedy steps, one token each
            active = [a for a in active if len(out[a[0]]) < a[3]
                      and self._grow(a[1], a[2], 1)]  # fmt: skip
            if not active:
                break
            logits = self.runner.step([a[2] for a in active],
                                      [self._lens[id(a[1])] for a in active],
                                      [[out[a[0]][-1]] for a in active])  # fmt: skip
            for row, (i, seq, _, _) in zip(logits, active):
                self._lens[id(seq)] += 1
                out[i].append(self._pick(seq, row))
        return out

    def _pick(self, seq, row: torch.Tensor) -> int:
        """The next draft of ``seq`` from the draft model's logits ``row`` ``[V]``."""
        p = seq.req.params
        if p.temperature == 0:
            return int(row.argmax())
        q = target_probs(row, p.temperature, p.top_k, p.top_p, p.min_p)
        self._q.setdefault(id(seq), []).append(q)
        return int(torch.multinomial(q, 1, generator=seq.generator))

    def _slot(self, seq):
        key = id(seq)
        if key not in self._slots:
            if not self.kv.capacity.free_slots:
                return None
            self._slots[key] = (seq, self.kv.new_sequence())
            self._lens[key] = 0
        return self._slots[key][1]

    def _grow(self, seq, slot: int, n: int) -> bool:
        """Room for ``n`` more tokens of ``seq`` in the draft cache (else its slot is freed,
        to catch up later from the start)."""
        if n == 0:
            return True
        if self._lens[id(seq)] + n <= self.kv.config.max_seq_len and self.kv.can_grow(slot, n):
            self.kv.grow(slot, n)
            return True
        self.kv.free(slot)
        del self._slots[id(seq)], self._lens[id(seq)]
        return False
