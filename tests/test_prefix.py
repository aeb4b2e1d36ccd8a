"""Prefix caching on both caches: shared prompts held once, LRU eviction of unreferenced
pages only, tenant salts, eviction before CacheFull, and a stateful machine whose K/V are a
function of (token, position), so that any reuse of a wrong page shows."""

from collections import Counter

import pytest
import torch
from caches import SPEC, examples, record_coverage, strict_host
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from vmcache.paged_fallback import PagedKVCache

from vmcache import CacheFull, VMKVCache


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
    return c.prefix.tokens_per_page


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_shared_system_prompt_is_held_once(kind):
    c = make(kind, pages=400, max_seq_len=2400)
    system = [(7 * i) % 50 for i in range(2000)]
    a = c.new_sequence(prefix_tokens=system + [1, 2, 3])
    assert c.seq_len(a) == 0  # nothing cached yet
    append(c, a, system + [1, 2, 3])
    c.cache_prefix(a)
    alone = c.stats().physical_pages
    b = c.new_sequence(prefix_tokens=system + [9, 9])
    hit = 2000 // tpp(c) * tpp(c)
    assert c.seq_len(b) == hit
    append(c, b, (system + [9, 9])[hit:])
    added = c.stats().physical_pages - alone
    assert added <= len(c.page_table(b)) * 2 + 1  # only b's tail pages are new
    for layer in range(SPEC.num_layers):
        kb, vb = c.kv(layer, b)
        assert torch.equal(kb, kv_of(system + [9, 9])) and torch.equal(vb, -kb)
        assert torch.equal(c.kv(layer, a)[0], kv_of(system + [1, 2, 3]))
    st_ = c.prefix.stats()
    assert st_.hit_tokens == hit and st_.lookups == 2
    c.check_invariants()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_lru_evicts_the_least_recently_used_unreferenced_prefix(kind):
    c = make(kind, pages=64)
    n = 2 * tpp(c)  # two full pages per prompt
    prompts = [[p] * n for p in (1, 2, 3)]
    for p in prompts:
        s = c.new_sequence(prefix_tokens=p)
        append(c, s, p)
        c.free(s)  # its pages stay cached
    per_prompt = c.prefix.stats().cached_pages // 3
    assert c.stats().physical_pages == 3 * per_prompt
    c.prefix.match(prompts[0])  # prompt 0 is now the most recently used
    live = c.new_sequence(prefix_tokens=prompts[2])  # prompt 2 is in use: never evicted
    assert c.seq_len(live) == n
    freed = c.prefix.reclaim(1)
    assert freed >= 1
    s1 = c.new_sequence(prefix_tokens=prompts[1])
    assert s1 in c.sequences and s1 != live
    assert c.seq_len(s1) < n  # prompt 1 (least recently used, unreferenced) lost pages
    for p in (prompts[0], prompts[2]):
        probe = c.new_sequence(prefix_tokens=p)
        assert c.seq_len(probe) == n
        c.free(probe)
    c.check_invariants()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_salts_never_share(kind):
    c = make(kind)
    p = [5] * (2 * tpp(c))
    a = c.new_sequence(prefix_tokens=p, salt="tenant-a")
    append(c, a, p)
    c.free(a)
    assert c.seq_len(c.new_sequence(prefix_tokens=p, salt="tenant-b")) == 0
    assert c.seq_len(c.new_sequence(prefix_tokens=p)) == 0
    assert c.seq_len(c.new_sequence(prefix_tokens=p, salt="tenant-a")) == len(p)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_cached_pages_are_evicted_before_cache_full(kind):
    c = make(kind, pages=16, max_seq_len=512)
    per_seq = c.pages_for_tokens(tpp(c))  # one page per table
    for i in range(16 // per_seq):  # fill the pool with unreferenced cached pages
        s = c.new_sequence(prefix_tokens=[i] * tpp(c))
        append(c, s, [i] * tpp(c))
        c.free(s)
    assert c.stats().free_pages == 0 and c.pool.can_allocate(16)
    s = c.new_sequence()
    c.grow(s, 16 // per_seq * tpp(c))  # needs every page: all cached ones are evicted
    assert c.prefix.stats().cached_pages == 0 and c.prefix.stats().evicted_pages == 16
    with pytest.raises(CacheFull):
        c.grow(s, tpp(c))
    c.check_invariants()


def test_bad_prefix_input():
    c = make("vm")
    with pytest.raises(TypeError, match="token ids"):
        c.new_sequence(prefix_tokens=["a"])
    s = c.new_sequence()
    with pytest.raises(ValueError, match="token ids"):
        c.grow(s, 3, token_ids=[1, 2])
    assert c.seq_len(s) == 0 and len(c.sequences) == 1


PREFIX_COVERAGE: dict[str, Counter] = {}  # kind -> lookups, hits, hit tokens, swap_in


def test_one_grow_evicts_the_least_recently_used_chain_first():
    """Chain A (2 pages) cached before chain B (3 pages), no free page: a grow by two pages
    evicts A's two, not one of each (a parent left a leaf by its child's eviction keeps its
    own place by last use, ahead of B)."""
    c = PagedKVCache(SPEC, num_blocks=5, block_size=4, max_seq_len=16, max_seqs=4,
                     prefix_caching=True)  # fmt: skip
    chain_a, chain_b = [1] * 8, [2] * 12
    for ids in (chain_a, chain_b):
        s = c.new_sequence(prefix_tokens=ids)
        append(c, s, ids)
        c.free(s)
    s = c.new_sequence()
    assert c.stats().free_pages == 0 and c.can_grow(s, 8)
    c.grow(s, 8)
    assert c.cached_prefix_tokens(chain_a) == 0
    assert c.cached_prefix_tokens(chain_b) == 12
    c.check_invariants()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_can_grow_does_not_count_a_cached_page_whose_child_is_in_use(kind):
    """A sequence's first page is cached, then copied on write: the index alone holds the
    old copy, but its child entry (page 1) is still mapped, so eviction cannot free it."""
    if kind == "paged":  # 4 blocks of 4: a's two, its copy of block 0, b's one
        c = PagedKVCache(SPEC, num_blocks=4, block_size=4, max_seq_len=16, max_seqs=4,
                         prefix_caching=True)  # fmt: skip
    else:  # the same in 4 tables (2 layers x K/V): 4 pages a page of tokens
        c = make("vm", pages=16, max_seq_len=256)
    P = tpp(c)
    a = c.new_sequence()
    append(c, a, list(range(2 * P)))
    c.cache_prefix(a)
    k = kv_of([99])
    for layer in range(SPEC.num_layers):
        c.write(layer, a, 0, k, -k)  # copies page 0 on write: the index keeps the old one
    b = c.new_sequence()
    c.grow(b, P)  # the last free pages
    assert c.stats().free_pages == 0
    assert c.prefix.reclaimable() == 0
    assert not c.can_grow(b, P)
    with pytest.raises(CacheFull):
        c.grow(b, P)
    c.free(a)  # now the whole chain is only the index's: both pages count, and go
    assert c.prefix.reclaimable() == c.pages_for_tokens(2 * P)
    assert c.can_grow(b, P)
    c.grow(b, P)
    c.check_invariants()


class PrefixMachine(RuleBasedStateMachine):
    """Sequences over a 3-token alphabet (so prefixes repeat) on a small pool; K/V are a
    function of (token, position), so a wrongly shared page breaks the content check."""

    kind = "vm"

    def __init__(self):
        super().__init__()
        # the same token capacity: 48 pages = 12 per (layer, K/V) table × 32 tokens,
        # 24 blocks × 16 tokens; small enough that cached pages get evicted
        pages = 48 if type(self).kind == "vm" else 24
        self.c = make(type(self).kind, pages=pages, max_seqs=6, max_seq_len=160)
        self.tokens: dict[int, list[int]] = {}
        self.swapped: list[tuple[object, list[int]]] = []
        self.seeded: list[int] = []  # the prompt every run starts from (cached)
        self.seen = PREFIX_COVERAGE.setdefault(type(self).kind, Counter())

    @initialize(data=st.data())
    def a_cached_prompt(self, data):
        """Every run starts with two full pages of a prompt cached (then freed), so that
        later prompts, drawn from the same chunks, can hit."""
        P = tpp(self.c)
        self.seeded = self._pages(data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=2)))
        s = self.c.new_sequence(prefix_tokens=self.seeded)
        append(self.c, s, self.seeded[self.c.seq_len(s) :] + [0] * (P // 2))
        self.c.free(s)  # indexes its full pages
        assert self.c.prefix.stats().cached_pages > 0

    def _pages(self, chunks):
        P = tpp(self.c)
        pages = [[0] * P, [1] * P, [0, 1] * (P // 2)]
        return [t for i in chunks for t in pages[i]]

    def teardown(self):
        for s in list(self.tokens):
            self.c.free(s)
        self.c.prefix.clear()
        assert self.c.stats().physical_pages == 0
        self.c.check_invariants()

    seqs = property(lambda self: sorted(self.tokens))

    def _ids(self, data, max_chunks, seeded=False):
        """Whole pages drawn from three page patterns (so the same page recurs under
        different prefixes), then a short random tail; with ``seeded``, often the start of
        the cached prompt first."""
        P = tpp(self.c)
        head = []
        if seeded and data.draw(st.integers(0, 2)) != 2:  # the simplest draw takes the head
            head = self.seeded[: P * data.draw(st.integers(1, len(self.seeded) // P))]
        chunks = data.draw(st.lists(st.integers(0, 2), max_size=max_chunks - len(head) // P))
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
        assert n % tpp(self.c) == 0 and n <= len(ids)
        self.seen["lookups"] += 1
        if n:
            event("prefix hit")
            self.seen["hits"] += 1
            self.seen["hit tokens"] += n
        self.tokens[s] = ids[:n]
        self.c._salts[s] = salt  # noqa: SLF001 - the machine keeps salts per sequence

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        ids = self._ids(data, 3)
        n = len(ids)
        if not ids or len(self.tokens[s]) + n > self.c.max_seq_len:
            return
        try:
            append(self.c, s, ids)
        except CacheFull:
            self.c.truncate(s, len(self.tokens[s]))  # a grow that succeeded, a write that did not
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
        ids = self._ids(data, 5)[: self.c.max_seq_len - len(self.tokens[s])]
        if ids:
            self._grow_checked(s, ids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def grow_until_refused(self, data):
        """Grow the live sequences a page at a time until the pool (after evicting what
        it can) refuses; can_grow is checked at every step."""
        for s in self.seqs:
            while len(self.tokens[s]) < self.c.max_seq_len:
                ids = self._ids(data, 1)[: self.c.max_seq_len - len(self.tokens[s])]
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
        self.c.truncate(s, n)
        self.tokens[s] = self.tokens[s][:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def assign(self, data):
        dsts = data.draw(st.lists(st.sampled_from(self.seqs), min_size=1, unique=True))
        srcs = [data.draw(st.sampled_from(self.seqs)) for _ in dsts]
        before = {s: list(self.tokens[s]) for s in srcs}
        self.c.assign(dsts, srcs)
        for d, s in zip(dsts, srcs):
            self.tokens[d] = list(before[s])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.seqs))
        self.swapped.append((self.c.swap_out(s), self.tokens.pop(s)))

    @precondition(lambda self: self.swapped)
    @rule()
    def swap_in(self):
        h, ids = self.swapped[0]
        try:
            s = self.c.swap_in(h)
        except CacheFull:
            return
        self.swapped.pop(0)
        self.tokens[s] = ids
        self.seen["swap_in"] += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def cache_prefix(self, data):
        self.c.cache_prefix(data.draw(st.sampled_from(self.seqs)))

    @rule(n=st.integers(1, 30))
    def evict(self, n):
        in_use = {p for s in self.tokens for t in self.c.page_table(s) for p in t}
        before = set(self.c.prefix.references())
        self.c.prefix.reclaim(n)
        evicted = before - set(self.c.prefix.references())
        assert not evicted & in_use  # never a page a sequence maps

    @invariant()
    def contents_are_their_tokens(self):
        for s, ids in self.tokens.items():
            assert self.c.seq_len(s) == len(ids)
            k, v = self.c.kv(1, s)
            assert torch.equal(k, kv_of(ids)) and torch.equal(v, -k)
        self.c.check_invariants()


def _machine_class(kind):
    return type(f"Prefix{kind}Machine", (PrefixMachine,), {"kind": kind})


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_the_prefix_machines_really_hit(kind):
    """A fixed-seed run reuses cached pages often (the machine would pass if matching
    always returned nothing otherwise) and swaps sequences out and back in."""
    from hypothesis.stateful import run_state_machine_as_test

    PREFIX_COVERAGE.pop(kind, None)
    run_state_machine_as_test(_machine_class(kind), settings=settings(
        max_examples=50, stateful_step_count=30, deadline=None, derandomize=True,
        database=None))  # fmt: skip
    seen = PREFIX_COVERAGE[kind]
    assert seen["hits"] >= 10 and seen["hits"] >= seen["lookups"] // 10, seen
    assert seen["swap_in"] >= 1, seen
    assert seen["grow refused"] >= 3, seen  # can_grow was tested where it matters
    record_coverage(f"prefix machine {kind}", seen)


def _machine(kind):
    case = _machine_class(kind).TestCase
    case.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)
    return case


TestVMPrefixMachine = _machine("vm")
TestPagedPrefixMachine = _machine("paged")
