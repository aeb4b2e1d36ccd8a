"""reserve(): pages of the next grow mapped ahead, taken by grow, given back by everything
that moves a row; best effort when the pool is short."""

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
    mapped = c.elastic.reserve(s, 200)
    assert mapped > 0 and c._reserved_pages_mapped == mapped
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
        c.elastic.reserve(s, 100)
    used = c.stats().physical_pages
    c.beams.truncate(a, 5)
    c.beams.assign([b], [a])
    check_invariants(c)
    assert c.stats().physical_pages < used
    c.elastic.reserve(a, 50)
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
    assert c.elastic.reserve(s, 16) == 0
    with pytest.raises(ValueError, match="n >= 0"):
        c.elastic.reserve(s, -1)
    with pytest.raises(KeyError):
        c.elastic.reserve(7, 1)
    check_invariants(c)
