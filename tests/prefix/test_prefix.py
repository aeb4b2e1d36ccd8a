"""Prefix caching on both caches: shared prompts held once, LRU eviction of unreferenced
pages only, tenant salts, eviction before CacheFull, and a stateful machine whose K/V are a
function of (token, position), so that any reuse of a wrong page shows."""

import pytest
import torch
from caches import SPEC, examples, record_coverage
from hypothesis import settings
from prefix_machine import PREFIX_COVERAGE, PrefixMachine, append, kv_of, make, tpp

from vmcache import CacheFull
from vmcache.paged_fallback import PagedKVCache
from vmcache.sequences.invariants import check_invariants


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_shared_system_prompt_is_held_once(kind):
    c = make(kind, pages=400, max_seq_len=2400)
    system = [(7 * i) % 50 for i in range(2000)]
    a = c.new_sequence(prefix_tokens=system + [1, 2, 3])
    assert c.seq_len(a) == 0  # nothing cached yet
    append(c, a, system + [1, 2, 3])
    c.prefix.publish(a)
    alone = c.stats().physical_pages
    b = c.new_sequence(prefix_tokens=system + [9, 9])
    hit = 2000 // c.prefix.hit_unit * c.prefix.hit_unit  # whole 16-token units
    assert c.seq_len(b) == hit
    append(c, b, (system + [9, 9])[hit:])
    added = c.stats().physical_pages - alone
    assert added <= len(c.views.page_table(b)) * 2 + 1  # only b's tail pages are new
    for layer in range(SPEC.num_layers):
        kb, vb = c.kv(layer, b)
        assert torch.equal(kb, kv_of(system + [9, 9])) and torch.equal(vb, -kb)
        assert torch.equal(c.kv(layer, a)[0], kv_of(system + [1, 2, 3]))
    st_ = c.prefix.index.stats()
    assert st_.hit_tokens == hit and st_.lookups == 2
    check_invariants(c)


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_lru_evicts_the_least_recently_used_unreferenced_prefix(kind):
    c = make(kind, pages=64)
    n = 2 * tpp(c)  # two full pages per prompt
    prompts = [[p] * n for p in (1, 2, 3)]
    for p in prompts:
        s = c.new_sequence(prefix_tokens=p)
        append(c, s, p)
        c.free(s)  # its pages stay cached
    per_prompt = c.prefix.index.stats().cached_pages // 3
    assert c.stats().physical_pages == 3 * per_prompt
    c.prefix.index.match(prompts[0])  # prompt 0 is now the most recently used
    live = c.new_sequence(prefix_tokens=prompts[2])  # prompt 2 is in use: never evicted
    assert c.seq_len(live) == n
    freed = c.prefix.index.reclaim(1)
    assert freed >= 1
    s1 = c.new_sequence(prefix_tokens=prompts[1])
    assert s1 in c.sequences and s1 != live
    assert c.seq_len(s1) < n  # prompt 1 (least recently used, unreferenced) lost pages
    for p in (prompts[0], prompts[2]):
        probe = c.new_sequence(prefix_tokens=p)
        assert c.seq_len(probe) == n
        c.free(probe)
    check_invariants(c)


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
    per_seq = c.capacity.pages_for_tokens(tpp(c))  # one page per table
    for i in range(16 // per_seq):  # fill the pool with unreferenced cached pages
        s = c.new_sequence(prefix_tokens=[i] * tpp(c))
        append(c, s, [i] * tpp(c))
        c.free(s)
    assert c.stats().free_pages == 0 and c._pool.can_allocate(16)
    s = c.new_sequence()
    c.grow(s, 16 // per_seq * tpp(c))  # needs every page: all cached ones are evicted
    assert c.prefix.index.stats().cached_pages == 0 and c.prefix.index.stats().evicted_pages == 16
    with pytest.raises(CacheFull):
        c.grow(s, tpp(c))
    check_invariants(c)


def test_bad_prefix_input():
    c = make("vm")
    with pytest.raises(TypeError, match="token ids"):
        c.new_sequence(prefix_tokens=["a"])
    s = c.new_sequence()
    with pytest.raises(ValueError, match="token ids"):
        c.grow(s, 3, token_ids=[1, 2])
    assert c.seq_len(s) == 0 and len(c.sequences) == 1


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
    assert c.prefix.cached_tokens(chain_a) == 0
    assert c.prefix.cached_tokens(chain_b) == 12
    check_invariants(c)


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
    c.prefix.publish(a)
    k = kv_of([99])
    for layer in range(SPEC.num_layers):
        c.write(layer, a, 0, k, -k)  # copies page 0 on write: the index keeps the old one
    b = c.new_sequence()
    c.grow(b, P)  # the last free pages
    assert c.stats().free_pages == 0
    assert c.prefix.index.reclaimable() == 0
    assert not c.can_grow(b, P)
    with pytest.raises(CacheFull):
        c.grow(b, P)
    c.free(a)  # now the whole chain is only the index's: both pages count, and go
    assert c.prefix.index.reclaimable() == c.capacity.pages_for_tokens(2 * P)
    assert c.can_grow(b, P)
    c.grow(b, P)
    check_invariants(c)


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
