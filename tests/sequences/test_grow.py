"""The one allocation call (``allocate``, :mod:`vmcache.sequences.grow`): a grow planned once,
None with nothing changed when the pool is short, ``can_grow`` the same plan as a query; pages
mapped ahead (``ahead``), taken by grow, given back by everything that moves a row; best effort
when the pool is short."""

import pytest
import torch
from caches import FACTORIES

from vmcache.sequences.invariants import check_invariants


def _free_pages(c):
    return c._pool.stats().free_pages


@pytest.mark.parametrize("name", list(FACTORIES))
def test_grow_takes_reserved_pages_without_allocating(name):
    c = FACTORIES[name]()
    s = c.new_sequence()
    c.grow(s, 10)
    x = torch.ones(10, 2, 16)
    c.write(0, s, 0, x, x)
    mapped = c.allocate(s, 0, ahead=200).ahead
    assert mapped > 0 and c._tx.pages_mapped_ahead == mapped
    # the table still covers only the length: reserved pages are mapped outside it
    assert (
        all(len(t) == c._groups[0].pages_for(10) for t in c.views.page_table(s))
        and c.seq_len(s) == 10
    )
    before = _free_pages(c)
    assert c.can_grow(s, 200)
    c.grow(s, 200)
    assert _free_pages(c) == before  # every page it needed was already mapped
    c.write(1, s, 150, torch.full((50, 2, 16), 2.0), torch.full((50, 2, 16), 2.0))
    assert torch.equal(c.kv(0, s)[0][:10], x) and (c.kv(1, s)[0][150:200] == 2).all()
    check_invariants(c)
    c.free(s)
    assert c.stats().physical_pages == 0


@pytest.mark.parametrize("name", list(FACTORIES))
def test_moves_of_a_row_give_reserved_pages_back(name):
    c = FACTORIES[name]()
    a, b = c.new_sequence(), c.new_sequence()
    for s in (a, b):
        c.grow(s, 20)
        c.allocate(s, 0, ahead=100)
    used = c.stats().physical_pages
    c.beams.truncate(a, 5)
    c.beams.assign([b], [a])
    check_invariants(c)
    assert c.stats().physical_pages < used
    c.allocate(a, 0, ahead=50)
    h = c.swap.out(a)
    check_invariants(c)
    c.swap.restore(h)
    for s in c.sequences:
        c.free(s)
    assert c.stats().physical_pages == 0


def test_reserve_is_best_effort_and_validates():
    c = FACTORIES["paged"](blocks=3)
    s = c.new_sequence()
    c.grow(s, 40)  # 3 blocks of 16: the pool is full
    assert c.allocate(s, 0, ahead=16).ahead == 0
    with pytest.raises(ValueError, match="ahead >= 0"):
        c.allocate(s, 0, ahead=-1)
    with pytest.raises(KeyError):
        c.allocate(7, 0, ahead=1)
    check_invariants(c)


def _state(c):
    return (c._pool.stats(), {s: (c.seq_len(s), c.views.page_table(s)) for s in c.sequences})


@pytest.mark.parametrize("name", list(FACTORIES))
def test_allocate_says_what_it_did_or_none_with_nothing_changed(name):
    """Short pool: None, every page and length as before, and can_grow said no for the same
    grow; after a free, the same call grows (pages, shared tail copied) and maps ahead."""
    small = {"vm": {"pages": 24}, "vm_token_major": {"pages": 12}, "paged": {"blocks": 6}}
    c = FACTORIES[name](**small[name])  # 6 pages a table
    s = c.new_sequence()
    full = c.capacity.available_pages // c.capacity.pages_for_tokens(1)
    per_page = c.config.max_seq_len // (c.capacity.pages_for_tokens(c.config.max_seq_len)
                                        // c.capacity.pages_for_tokens(1))  # fmt: skip
    got = c.allocate(s, per_page)
    assert got is not None and got.copied == 0 and got.ahead == 0
    assert got.pages == c.capacity.pages_for_tokens(per_page) == c.capacity.mapped_pages(s)
    (child,) = c.fork(s)
    other = c.new_sequence()
    c.grow(other, per_page * (full - 2))  # what is left: one page per table
    before = _state(c)
    want = 2 * per_page + 1  # three new pages a table (the tail is full): one is left
    assert not c.can_grow(child, want)
    assert c.allocate(child, want, ahead=per_page) is None
    assert _state(c) == before
    check_invariants(c)
    c.free(other)
    assert c.can_grow(child, 1)
    got = c.allocate(child, 1, token_ids=[5], ahead=per_page)
    tables = c.capacity.pages_for_tokens(1)
    assert got.copied == 0 and got.pages == tables  # the tail page was full: a new page
    assert got.ahead == tables and c.seq_len(child) == per_page + 1
    assert c.capacity.mapped_pages(child) == 3 * tables  # shared page, new page, one ahead
    check_invariants(c)


@pytest.mark.parametrize("name", list(FACTORIES))
def test_allocate_copies_a_shared_tail_and_validates_first(name):
    c = FACTORIES[name]()
    s = c.new_sequence()
    c.grow(s, 3)
    (child,) = c.fork(s)
    got = c.allocate(child, 1)
    assert got.copied == got.pages == c.capacity.pages_for_tokens(1)  # the tail, per table
    before = _state(c)
    for bad, err in (((child, -1), ValueError), ((child, 1.5), TypeError),
                     ((child, 1, [1, 2]), ValueError), ((99, 1), KeyError)):  # fmt: skip
        with pytest.raises(err):
            c.allocate(*bad)
    with pytest.raises(ValueError, match="ahead >= 0"):
        c.allocate(child, 1, ahead=-2)
    with pytest.raises(ValueError, match="max_seq_len"):
        c.allocate(child, c.config.max_seq_len)
    assert _state(c) == before
    check_invariants(c)
