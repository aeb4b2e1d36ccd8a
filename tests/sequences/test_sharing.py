"""fork / assign / truncate / write_group on both caches: page accounting and contents."""

import pytest
import torch
from caches import FACTORIES

from vmcache import CacheFull
from vmcache.sequences.invariants import check_invariants

CACHES = list(FACTORIES)


def _fill(c, s, n, value):
    start = c.seq_len(s)
    c.grow(s, n)
    for layer in range(c.spec.num_layers):
        x = torch.full((n, 2, 16), float(value))
        c.write(layer, s, start, x, x)


def _pages(c, s):
    return [p for t in c.views.page_table(s) for p in t]


@pytest.mark.parametrize("name", CACHES)
def test_assign_remaps_only_differing_entries_and_copies_nothing(name):
    c = FACTORIES[name]()
    a = c.new_sequence()
    _fill(c, a, 40, 1)
    b, d = c.fork(a, 2)
    _fill(c, b, 60, 2)  # b = a's 40 tokens + 60 of its own (its tail page was split)
    shared_before = set(_pages(c, a)) & set(_pages(c, b))
    copies_before = c.stats().cow_copies  # b's tail split, one page per table
    assert copies_before == len(c.views.page_table(b))
    c.beams.assign([d, a], [b, b])  # both become copies of b
    for s in (d, a):
        assert c.seq_len(s) == 100
        assert _pages(c, s) == _pages(c, b)
        k, _ = c.kv(1, s)
        assert (k[:40] == 1).all() and (k[40:] == 2).all()
    assert c.stats().cow_copies == copies_before  # assign copied nothing
    assert shared_before <= set(_pages(c, a))  # the common history was never unmapped
    check_invariants(c)
    for s in (a, b, d):
        c.free(s)
    assert c.stats().physical_pages == 0


@pytest.mark.parametrize("name", CACHES)
def test_assign_copies_a_tail_its_destination_holds_alone_instead_of_remapping_it(name):
    c = FACTORIES[name]()
    a = c.new_sequence()
    _fill(c, a, 40, 1)
    b, d = c.fork(a, 2)
    _fill(c, b, 5, 2)  # b and d each split the shared tail page: their own, refcount 1
    _fill(c, d, 5, 3)
    tails_d = [t[-1] for t in c.views.page_table(d)]
    heads_b = [t[:-1] for t in c.views.page_table(b)]
    copies = c.stats().cow_copies
    c.beams.assign([d], [b])  # d becomes b: b's tail copied into d's own tail page
    assert [t[-1] for t in c.views.page_table(d)] == tails_d  # kept, not remapped
    assert [t[:-1] for t in c.views.page_table(d)] == heads_b  # the history is shared
    tables = len(tails_d)
    assert c.stats().cow_copies == copies + tables  # one copy per table, none later:
    k, v = c.kv(1, d)
    assert (k[:40] == 1).all() and (k[40:] == 2).all() and (v[40:] == 2).all()
    _fill(c, d, 1, 4)  # d's next write lands in its own page: no split
    assert c.stats().cow_copies == copies + tables
    k, _ = c.kv(1, b)
    assert c.seq_len(b) == 45 and (k[40:] == 2).all()  # the source is untouched
    check_invariants(c)


@pytest.mark.parametrize("name", CACHES)
def test_assign_of_a_swap_moves_the_tails_each_other_still_needs(name):
    """A swap moves pages, sharing nothing: the paged cache rewrites its block tables, VMKVCache
    copies both ways (each source read before either page is written) and maps nothing."""
    c = FACTORIES[name]()
    a = c.new_sequence()
    _fill(c, a, 40, 1)
    (b,) = c.fork(a, 1)
    _fill(c, a, 5, 2)
    _fill(c, b, 5, 3)
    pa, pb = _pages(c, a), _pages(c, b)
    copies = c.stats().cow_copies
    c.beams.assign([a, b], [b, a])
    if c._copies_moves:
        assert (_pages(c, a), _pages(c, b)) == (pa, pb)
        assert c.stats().cow_copies == copies + 2 * len(c.views.page_table(a))
    else:
        assert (_pages(c, a), _pages(c, b)) == (pb, pa)
        assert c.stats().cow_copies == copies
    ka, _ = c.kv(1, a)
    kb, _ = c.kv(1, b)
    assert (ka[:40] == 1).all() and (kb[:40] == 1).all()
    assert (ka[40:] == 3).all() and (kb[40:] == 2).all()
    check_invariants(c)


@pytest.mark.parametrize("name", CACHES)
def test_assign_of_a_rotation_with_a_duplicate_keeps_full_pages_shared(name):
    """Three beams, full pages and tails: b ← a, c ← b, a ← a. Every page a remap would move is
    copied (VMKVCache) or remapped (paged); c's old pages are freed, and a's full pages, taken
    by a and b, stay one shared copy on either cache."""
    cache = FACTORIES[name]()
    a = cache.new_sequence()
    _fill(cache, a, 4, 1)
    b, c = cache.fork(a, 2)
    for s, value in ((a, 2), (b, 3), (c, 4)):
        _fill(cache, s, 70, value)  # 74 tokens: full pages and a tail, each its own
    before = {s: _pages(cache, s) for s in (a, b, c)}
    held = cache.stats().physical_pages
    cache.beams.assign([b, c, a], [a, b, a])
    for s, value in ((a, 2), (b, 2), (c, 3)):
        k, v = cache.kv(1, s)
        assert cache.seq_len(s) == 74
        assert (k[:4] == 1).all() and (k[4:] == value).all() and (v[4:] == value).all()
    assert _pages(cache, a) == before[a]
    if cache._copies_moves:  # b's pages moved to c: copied into c's own
        assert _pages(cache, c) == before[c]
    heads = {s: [t[:-1] for t in cache.views.page_table(s)] for s in (a, b)}
    assert heads[a] == heads[b]  # the full pages b takes from a: shared, not copied
    assert cache.stats().physical_pages < held
    check_invariants(cache)
    for s in (a, b, c):
        cache.free(s)
    assert cache.stats().physical_pages == 0


@pytest.mark.parametrize("name", CACHES)
def test_assign_validates_before_changing_anything(name):
    c = FACTORIES[name]()
    a = c.new_sequence()
    _fill(c, a, 5, 1)
    before = c.views.page_table(a)
    with pytest.raises(ValueError, match="distinct"):
        c.beams.assign([a, a], [a, a])
    with pytest.raises(ValueError, match="as many"):
        c.beams.assign([a], [a, a])
    with pytest.raises(KeyError):
        c.beams.assign([a], [7])
    assert c.views.page_table(a) == before


@pytest.mark.parametrize("name", CACHES)
def test_truncate_releases_pages_and_regrowth_of_a_private_tail_copies_nothing(name):
    c = FACTORIES[name]()
    a = c.new_sequence()
    _fill(c, a, 100, 3)
    b = c.fork(a)[0]
    full = c.stats().physical_pages
    c.beams.truncate(b, 20)
    assert c.seq_len(b) == 20 and c.stats().physical_pages == full  # a still holds them all
    c.beams.truncate(a, 0)
    assert c.stats().physical_pages == len(_pages(c, b)) > 0
    _fill(c, b, 5, 4)  # b's tail page is private now: no copy
    assert c.stats().cow_copies == 0
    k, _ = c.kv(0, b)
    assert (k[:20] == 3).all() and (k[20:] == 4).all()
    with pytest.raises(ValueError, match="truncate length"):
        c.beams.truncate(b, 26)
    c.free(a)
    c.free(b)
    check_invariants(c)
    assert c.stats().physical_pages == 0


@pytest.mark.parametrize("name", CACHES)
def test_write_group_writes_shared_pages_once_in_place(name):
    c = FACTORIES[name]()
    a = c.new_sequence()
    c.grow(a, 30)
    group = [a] + c.fork(a, 3)
    x = torch.arange(30 * 32, dtype=torch.float32).reshape(30, 2, 16)
    for layer in range(2):
        c.beams.write_group(layer, group, 0, x, -x)
    st = c.stats()
    assert st.cow_copies == 0 and st.physical_pages == len(_pages(c, a))
    for s in group:
        k, v = c.kv(1, s)
        assert torch.equal(k, x) and torch.equal(v, -x)
    # an outsider holding the same pages keeps its bytes: the group copies first
    outsider = c.fork(a)[0]
    c.beams.write_group(0, group[:2], 0, x + 1, x + 1)
    assert torch.equal(c.kv(0, outsider)[0], x) and torch.equal(c.kv(0, group[2])[0], x)
    assert torch.equal(c.kv(0, group[0])[0], x + 1) and torch.equal(c.kv(0, group[1])[0], x + 1)
    assert c.stats().cow_copies > 0
    check_invariants(c)


@pytest.mark.parametrize("name", CACHES)
def test_new_sequence_in_a_chosen_slot(name):
    c = FACTORIES[name]()
    assert c.new_sequence(slot=5) == 5
    with pytest.raises(ValueError, match="not free"):
        c.new_sequence(slot=5)
    with pytest.raises(ValueError, match="not free"):
        c.new_sequence(slot=99)
    assert c.new_sequence() != 5
    check_invariants(c)


@pytest.mark.parametrize("name", CACHES)
def test_cow_bytes_count_only_the_used_part_of_a_split_page(name):
    c = FACTORIES[name]()
    a = c.new_sequence()
    _fill(c, a, 3, 1)
    b = c.fork(a)[0]
    _fill(c, b, 1, 2)  # splits b's tail: 3 tokens in use, in every table of the page
    st = c.stats()
    assert st.cow_copies == len(c.views.page_table(b)) and st.cow_bytes_copied == c.spec.kv_bytes(3)


def _state(c):
    tables = {s: (c.seq_len(s), c.views.page_table(s)) for s in c.sequences}
    kv = {s: [torch.cat(c.kv(layer, s)).clone() for layer in range(2)] for s in c.sequences}
    return c.stats(), tables, kv


@pytest.mark.parametrize("name", CACHES)
def test_write_group_is_all_or_nothing_when_the_pool_runs_out(name):
    """Members b and c share pages with a third sequence a: each needs its own copies. With
    room for one member's copies only, the call raises CacheFull and changes nothing (it used
    to commit b's copy-on-write split, then fail on c)."""
    size = {"blocks": 6} if name == "paged" else {"pages": 12}
    c = FACTORIES[name](**size)
    a = c.new_sequence()
    _fill(c, a, 40, 1)
    b, d = c.fork(a, 2)
    free = c.stats().free_pages
    per_member = len(c._tables_of_layer(0)) * len(c.views.page_table(a)[0])  # a's layer-0 pages
    assert per_member <= free < 2 * per_member  # room for one member's copies, not two
    before = _state(c)
    x = torch.full((40, 2, 16), 9.0)
    with pytest.raises(CacheFull):
        c.beams.write_group(0, [b, d], 0, x, x)
    after = _state(c)
    assert before[0] == after[0] and before[1] == after[1]
    assert all(torch.equal(p, q) for s in before[2] for p, q in zip(before[2][s], after[2][s]))
    check_invariants(c)


@pytest.mark.parametrize("name", CACHES)
def test_assign_from_an_empty_sequence_gives_each_its_own_token_list(name):
    """assign used to hand the destination the source's very list when it was empty; growing
    the source then gave the destination tokens it did not hold, and it could never be
    swapped back in."""
    c = FACTORIES[name]()
    a, b = c.new_sequence(), c.new_sequence()
    c.grow(b, 2, token_ids=[5, 6])
    c.beams.assign([b], [a])
    c.grow(a, 3, token_ids=[1, 2, 3])
    assert c.seq_len(b) == 0
    check_invariants(c)  # token ids known => as many as the sequence's length
    back = c.swap.restore(c.swap.out(b))
    assert c.seq_len(back) == 0
    c.grow(back, 1, token_ids=[7])
    check_invariants(c)
