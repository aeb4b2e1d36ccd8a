"""The prefix-caching helpers and state machine shared by tests/prefix/test_prefix.py and
tests/prefix/test_tiers.py: both caches on a small pool, K/V a function of (token, position) (so any
reuse of a wrong page shows), and the machine that drives lookups, growth, forks, swaps and
eviction against the tokens each sequence should hold."""

from collections import Counter

import torch
from caches import SPEC, strict_host
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from vmcache import CacheFull, VMKVCache
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants

PREFIX_COVERAGE: dict[str, Counter] = {}  # kind -> lookups, hits, hit tokens, swap_in


def make(kind, pages=64, **kw):
    kw.setdefault("max_seqs", 8)
    kw.setdefault("max_seq_len", 256)
    if kind == "vm":  # 4 KiB pages = 64 tokens of one (layer, K/V) row at 64 B per token
        return VMKVCache(
            SPEC,
            page_size=4096,
            backend=strict_host(),
            own_backend=True,
            pool_bytes=pages * 4096,
            prefix_caching=True,
            **kw,
        )
    return PagedKVCache(SPEC, num_blocks=pages, block_size=16, prefix_caching=True, **kw)


def kv_of(tokens, start=0):
    """K (and V = −K) of tokens at positions start...: a function of (token, position)."""
    ids = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)
    return (ids + 1000 * pos)[:, None, None].expand(len(tokens), 2, 16).contiguous()


def append(c, s, tokens):
    start = c.seq_len(s)
    c.grow(s, len(tokens), token_ids=tokens)
    k = kv_of(tokens, start)
    for layer in range(SPEC.num_layers):
        c.write(layer, s, start, k, -k)


def tpp(c):
    return c.prefix.tokens_per_entry


class PrefixMachine(RuleBasedStateMachine):
    """Sequences over a 3-token alphabet (so prefixes repeat) on a small pool; K/V are a
    function of (token, position), so a wrongly shared page breaks the content check."""

    kind = "vm"
    pattern_tails = False  # tails often the start of a page pattern (16-token unit hits)
    coverage = None  # its PREFIX_COVERAGE key (None: its kind)

    def __init__(self):
        super().__init__()
        # the same token capacity: 48 pages = 12 per (layer, K/V) table × 32 tokens,
        # 24 blocks × 16 tokens; small enough that cached pages get evicted
        pages = 48 if type(self).kind == "vm" else 24
        self.c = make(type(self).kind, pages=pages, max_seqs=6, max_seq_len=160)
        self.tokens: dict[int, list[int]] = {}
        self.swapped: list[tuple[object, list[int]]] = []
        self.seeded: list[int] = []  # the prompt every run starts from (cached)
        self.seen = PREFIX_COVERAGE.setdefault(type(self).coverage or type(self).kind, Counter())

    @initialize(data=st.data())
    def a_cached_prompt(self, data):
        """Every run starts with two full pages of a prompt cached (then freed), so that
        later prompts, drawn from the same chunks, can hit."""
        P = tpp(self.c)
        self.seeded = self._pages(data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=2)))
        s = self.c.new_sequence(prefix_tokens=self.seeded)
        append(self.c, s, self.seeded[self.c.seq_len(s) :] + [0] * (P // 2))
        self.c.free(s)  # indexes its full pages
        assert self.c.prefix.index.stats().cached_pages > 0

    def _pages(self, chunks):
        P = tpp(self.c)
        pages = [[0] * P, [1] * P, [0, 1] * (P // 2)]
        return [t for i in chunks for t in pages[i]]

    def teardown(self):
        for s in list(self.tokens):
            self.c.free(s)
        self.c.prefix.index.clear()
        assert self.c.stats().physical_pages == 0
        check_invariants(self.c)

    seqs = property(lambda self: sorted(self.tokens))

    def _ids(self, data, max_chunks, seeded=False):
        """Whole pages drawn from three page patterns (so the same page recurs under
        different prefixes), then a short tail: random, or with ``pattern_tails`` often the
        start of a pattern (so part of a block recurs: 16-token unit hits); with ``seeded``,
        often the start of the cached prompt first."""
        P = tpp(self.c)
        head = []
        if seeded and data.draw(st.integers(0, 2)) != 2:  # the simplest draw takes the head
            head = self.seeded[: P * data.draw(st.integers(1, len(self.seeded) // P))]
        chunks = data.draw(st.lists(st.integers(0, 2), max_size=max_chunks - len(head) // P))
        if self.pattern_tails and data.draw(st.booleans()):  # part of a block recurs
            n = data.draw(st.integers(1 if head else 0, P - 1))
            tail = self._pages([data.draw(st.integers(0, 2))])[:n]
        else:
            tail = data.draw(st.lists(st.integers(0, 2), min_size=1 if head else 0, max_size=P))
        return head + self._pages(chunks) + tail

    @rule(data=st.data())
    def new_with_prefix(self, data):
        ids = self._ids(data, 140 // tpp(self.c), seeded=True)
        salt = data.draw(st.sampled_from([None, None, "x"]))
        try:
            s = self.c.new_sequence(prefix_tokens=ids, salt=salt)
        except CacheFull:
            return
        n = self.c.seq_len(s)
        assert n % self.c.prefix.hit_unit == 0 and n <= len(ids)
        self.seen["lookups"] += 1
        if n:
            event("prefix hit")
            self.seen["hits"] += 1
            self.seen["hit tokens"] += n
            if n % tpp(self.c):
                event("prefix hit in 16-token units (part of a block)")
                self.seen["unit hits"] += 1
        self.tokens[s] = ids[:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        ids = self._ids(data, 3)
        n = len(ids)
        if not ids or len(self.tokens[s]) + n > self.c.config.max_seq_len:
            return
        try:
            append(self.c, s, ids)
        except CacheFull:
            self.c.beams.truncate(
                s, len(self.tokens[s])
            )  # a grow that succeeded, a write that did not
            return
        self.tokens[s] += ids

    def _grow_checked(self, s, ids) -> bool:
        """Grow ``s`` by ``ids`` (then write them) if the cache says it can: a scheduler
        trusts can_grow, so it must say yes exactly when the grow succeeds."""
        said = self.c.can_grow(s, len(ids))
        try:
            self.c.grow(s, len(ids), token_ids=ids)
        except CacheFull:
            assert not said, "can_grow said yes, grow raised CacheFull"
            self.seen["grow refused"] += 1
            return False
        assert said, "can_grow said no, grow succeeded"
        self.seen["grow allowed"] += 1
        start = len(self.tokens[s])
        k = kv_of(ids, start)
        for layer in range(SPEC.num_layers):
            self.c.write(layer, s, start, k, -k)
        self.tokens[s] += ids
        return True

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def grow_as_can_grow_says(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        ids = self._ids(data, 5)[: self.c.config.max_seq_len - len(self.tokens[s])]
        if ids:
            self._grow_checked(s, ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def grow_until_refused(self, data):
        """Grow the live sequences a page at a time until the pool (after evicting what
        it can) refuses; can_grow is checked at every step."""
        for s in self.seqs:
            while len(self.tokens[s]) < self.c.config.max_seq_len:
                ids = self._ids(data, 1)[: self.c.config.max_seq_len - len(self.tokens[s])]
                if ids and not self._grow_checked(s, ids):
                    return

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        try:
            (k,) = self.c.fork(s)
        except CacheFull:
            return
        self.tokens[k] = list(self.tokens[s])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.c.free(s)
        del self.tokens[s]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        n = data.draw(st.integers(0, len(self.tokens[s])))
        self.c.beams.truncate(s, n)
        self.tokens[s] = self.tokens[s][:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def assign(self, data):
        dsts = data.draw(st.lists(st.sampled_from(self.seqs), min_size=1, unique=True))
        srcs = [data.draw(st.sampled_from(self.seqs)) for _ in dsts]
        before = {s: list(self.tokens[s]) for s in srcs}
        self.c.beams.assign(dsts, srcs)
        for d, s in zip(dsts, srcs):
            self.tokens[d] = list(before[s])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.swapped.append((self.c.swap.out(s), self.tokens.pop(s)))

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        h, ids = self.swapped[0]
        try:
            s = self.c.swap.restore(h)
        except CacheFull:
            return
        self.swapped.pop(0)
        self.tokens[s] = ids
        self.seen["swap_in"] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_prefix(self, data):
        self.c.prefix.publish(data.draw(st.sampled_from(self.seqs)))

    @rule(n=st.integers(1, 30))
    def evict(self, n):
        in_use = {p for s in self.tokens for t in self.c.views.page_table(s) for p in t}
        before = set(self.c.prefix.index.references())
        self.c.prefix.index.reclaim(n)
        evicted = before - set(self.c.prefix.index.references())
        assert not evicted & in_use  # never a page a sequence maps

    @invariant()
    def contents_are_their_tokens(self):
        for s, ids in self.tokens.items():
            assert self.c.seq_len(s) == len(ids)
            k, v = self.c.kv(1, s)
            assert torch.equal(k, kv_of(ids)) and torch.equal(v, -k)
        check_invariants(self.c)
