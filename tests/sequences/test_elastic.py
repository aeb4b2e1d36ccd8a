"""Elastic memory (vmcache/elastic.py): free pages' memory given back (trim), a limit moved
at run time, sleep/wake with the same addresses; both caches, VMKVCache under the CUDA page
rules (a release of a page still mapped anywhere is refused)."""

import pytest
import torch
from cache_machine import COVERAGE, POOLS, CacheMachine, machine_class
from caches import FACTORIES, SPEC, examples, paged, vm
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from vmcache import CacheFull
from vmcache.sequences.invariants import check_invariants


def fill(c, s, n, value):
    start = c.seq_len(s)
    c.grow(s, n)
    k = torch.full((n, 2, 16), float(value))
    for layer in range(SPEC.num_layers):
        c.write(layer, s, start, k, -k)


def contents(c):
    return {s: [torch.cat(c.kv(layer, s)).clone() for layer in range(2)] for s in c.sequences}


def same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(x, y) for s in a for x, y in zip(a[s], b[s])
    )  # fmt: skip


def test_trim_gives_free_pages_back_and_they_come_back_on_demand():
    c = vm(pages=64, chunk_pages=8)
    a, b = c.new_sequence(), c.new_sequence()
    fill(c, a, 100, 1)
    fill(c, b, 100, 2)
    held = c.elastic.resident_bytes
    c.free(b)
    want = contents(c)
    free_pages = c._pool.num_free
    released = c.elastic.trim()
    assert released > 0 and c.elastic.resident_bytes == held - released
    assert (
        c.elastic.resident_bytes == c.stats().physical_pages * c.config.page_bytes
    )  # only mapped pages
    assert c._pool.num_free == free_pages  # what a grow can get is unchanged
    assert same(want, contents(c))  # mapped pages untouched
    b = c.new_sequence()
    fill(c, b, 100, 3)  # created again, as zeros, then written
    assert torch.equal(c.kv(0, b)[0], torch.full((100, 2, 16), 3.0))
    check_invariants(c)
    c.close()


def test_a_lower_limit_refuses_growth_and_a_higher_one_allows_it():
    c = vm(pages=64)
    s = c.new_sequence()
    fill(c, s, 64, 1)  # 2 pages per table, 8 in all
    c.elastic.set_limit(8 * c.config.page_bytes)
    assert c.elastic.resident_bytes == 8 * c.config.page_bytes  # the free chunk went back at once
    assert not c.can_grow(s, 32)
    with pytest.raises(CacheFull, match="budget"):
        c.grow(s, 32)
    assert c.seq_len(s) == 64
    c.elastic.set_limit(12 * c.config.page_bytes)
    assert c.can_grow(s, 32)
    fill(c, s, 32, 2)
    c.elastic.set_limit(0)  # below what is mapped: nothing mapped is touched
    assert c.seq_len(s) == 96 and c.elastic.resident_bytes == 12 * c.config.page_bytes
    assert not c.can_grow(s, 32) and c.can_grow(s, 0)
    c.free(s)
    c.elastic.trim()
    assert c.elastic.resident_bytes == 0
    check_invariants(c)
    with pytest.raises(ValueError):
        c.elastic.set_limit(-1)
    c.close()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_a_lowered_limit_holds_once_the_sequences_over_it_end(kind):
    """Pages freed while the cache holds more than its limit are released, not kept on the
    free list for the next grow (which would keep twice the limit and grow past it)."""
    c = FACTORIES[kind]()
    a, b = c.new_sequence(), c.new_sequence()
    fill(c, a, 64, 1)
    fill(c, b, 64, 2)
    used = c._pool.num_used
    limit = used // 2
    c.elastic.set_limit(limit * c.config.page_bytes)
    assert c._pool.num_created == used  # mapped pages stay until their sequences end
    c.free(b)
    assert c._pool.num_created == max(limit, c._pool.num_used)  # b's pages went back
    assert c._pool.budget.held == c._pool.num_created
    assert not c.can_grow(a, 64)
    with pytest.raises(CacheFull, match="budget"):
        c.grow(a, 64)
    c.free(a)
    assert c._pool.num_created <= limit
    s = c.new_sequence()
    fill(c, s, 16, 3)
    assert c._pool.num_created <= limit
    check_invariants(c)
    c.close()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_nothing_starts_while_asleep(kind):
    c = FACTORIES[kind]()
    s = c.new_sequence()
    fill(c, s, 8, 1)
    c.elastic.sleep()
    free_slots = c.capacity.free_slots
    with pytest.raises(RuntimeError, match="asleep"):
        c.new_sequence()
    with pytest.raises(RuntimeError, match="asleep"):
        c.new_sequence(prefix_tokens=[1, 2, 3])
    assert c.capacity.free_slots == free_slots and c.sequences == [s]
    c.elastic.wake()
    assert c.new_sequence() != s
    c.close()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_sleep_and_wake_keep_every_sequence_at_the_same_addresses(kind):
    c = FACTORIES[kind](prefix_caching=True)
    a = c.new_sequence()
    c.grow(a, 40, token_ids=list(range(40)))
    k = torch.arange(40 * 32, dtype=torch.float32).view(40, 2, 16)
    for layer in range(2):
        c.write(layer, a, 0, k, -k)
    (b,) = c.fork(a)
    fill(c, b, 5, 9)  # copy-on-write of the shared tail
    c.prefix.publish(a)
    handle = c.swap.out(c.fork(a)[0])
    want, tables = contents(c), {s: c.views.page_table(s) for s in c.sequences}
    views = [c.kv(layer, a) for layer in range(2)]  # taken before sleep
    ptrs = [t.data_ptr() for v in views for t in v]
    released = c.elastic.sleep()
    assert released > 0 and c.elastic.asleep
    if c.elastic.releases:
        assert c.elastic.resident_bytes == 0
        assert c._backend.live_handles() == 0  # every page released (the strict backend counts)
    else:
        assert c._kv_pool.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        c.grow(a, 1)
    with pytest.raises(RuntimeError, match="asleep"):
        c.elastic.sleep()
    c.elastic.wake()
    assert not c.elastic.asleep
    assert same(want, contents(c)) and tables == {s: c.views.page_table(s) for s in c.sequences}
    if c.elastic.releases:  # the same virtual addresses: views taken before read the bytes
        assert [t.data_ptr() for v in views for t in v] == ptrs
        assert torch.equal(views[0][0], k) and torch.equal(views[1][1], -k)
    assert c.prefix.cached_tokens(list(range(40))) > 0  # the prefix index survived
    s = c.swap.restore(handle)
    assert torch.equal(c.kv(0, s)[0], k)
    check_invariants(c)
    for s in c.sequences:
        c.free(s)
    c.prefix.index.clear()
    assert c.stats().physical_pages == 0
    c.close()


@pytest.mark.parametrize("kind", ["vm", "paged"])
def test_sleep_without_keeping_drops_contents_and_the_prefix_index(kind):
    c = FACTORIES[kind](prefix_caching=True)
    s = c.new_sequence()
    c.grow(s, 40, token_ids=list(range(40)))
    fill(c, s, 0, 0)
    k = torch.ones(40, 2, 16)
    c.write(0, s, 0, k, k)
    c.prefix.publish(s)
    c.elastic.sleep(keep="none")
    c.elastic.wake()
    assert c.seq_len(s) == 40 and not c.kv(0, s)[0].any()  # zeros: nothing was kept
    assert c.prefix.cached_tokens(list(range(40))) == 0
    check_invariants(c)
    c.close()


def test_wake_over_budget_is_cache_full_and_the_cache_stays_asleep():
    c = vm(pages=64)
    s = c.new_sequence()
    fill(c, s, 64, 5)
    c.elastic.sleep()
    c.elastic.set_limit(4 * c.config.page_bytes)  # less than its 8 live pages
    with pytest.raises(CacheFull, match="waking"):
        c.elastic.wake()
    assert c.elastic.asleep and c.elastic.resident_bytes == 0
    c.elastic.set_limit(64 * c.config.page_bytes)
    c.elastic.wake()
    assert torch.equal(c.kv(1, s)[0], torch.full((64, 2, 16), 5.0))
    check_invariants(c)
    c.close()


def test_bad_sleep_arguments_change_nothing():
    c = paged()
    with pytest.raises(ValueError, match="keep"):
        c.elastic.sleep(keep="disk")
    with pytest.raises(RuntimeError, match="not asleep"):
        c.elastic.wake()
    assert not c.elastic.asleep


class ElasticMachine(CacheMachine):
    """The same machine with elastic memory too: trims, limits lowered below the next grow
    and lifted, sleeps that keep or drop the contents, all against the same shadow."""

    @invariant()
    def the_limit_holds(self):
        """Never more pages with memory than the limit, unless mapped ones are over it."""
        pool = self.c._pool
        assert pool.num_created <= max(pool.budget.limit, pool.num_used) or pool.asleep

    @rule(what=st.sampled_from(["lower", "trim", "lift"]), k=st.integers(0, 3))
    def shrink_or_grow(self, what, k):
        """Free pages' memory back (``k`` pages kept), or the limit lowered to what is in
        use + ``k`` pages, or lifted."""
        c, pool = self.c, self.c._pool
        if what == "trim":
            free, held = pool.num_free, c.elastic.resident_bytes
            released = c.elastic.trim(k * c.config.page_bytes)
            assert pool.num_free == free  # released pages can be created again
            assert not c.elastic.releases or c.elastic.resident_bytes == held - released
        elif what in ("lower", "lift"):
            pages = pool.num_used + k if what == "lower" else pool.num_pages
            c.elastic.set_limit(pages * c.config.page_bytes)
            assert pool.num_free <= max(0, pages - pool.num_used) + len(pool._free)
        self.seen[what] += 1

    @rule(keep=st.sampled_from(["host", "none"]))
    def sleep_and_wake(self, keep):
        """Every page released and brought back at the same addresses; with keep="none" the
        contents read zeros after (the shadow follows)."""
        c = self.c
        views = {s: [c.kv(layer, s) for layer in range(2)] for s in self.shadow}
        c.elastic.sleep(keep)
        assert c.elastic.asleep and (c.elastic.resident_bytes == 0 or not c.elastic.releases)
        try:
            c.elastic.wake()
        except CacheFull:  # a lowered limit below what is live: lift it, then wake
            c.elastic.set_limit(c._pool.num_pages * c.config.page_bytes)
            c.elastic.wake()
        for s, layers in self.shadow.items():
            if keep == "none":
                for x in layers:
                    x.zero_()
            elif c.elastic.releases:  # views taken before sleep read the same bytes
                for layer, (k, v) in enumerate(views[s]):
                    want = layers[layer][c.views.window_start(layer, s) :]
                    known = ~torch.isnan(want)
                    assert torch.equal(torch.stack((k, v), 1)[known], want[known])
        self.seen[f"sleep {keep}"] += 1


def _elastic_class(name):
    attrs = {k: v for k, v in vars(machine_class(name)).items() if not k.startswith("__")}
    attrs["name"] = f"{name} elastic"
    return type(f"{name}ElasticMachine", (ElasticMachine,), attrs)


for _name in POOLS:  # full attention, both caches and layouts, against the shadow
    _case = _elastic_class(_name).TestCase
    _case.settings = settings(max_examples=examples(30), stateful_step_count=30, deadline=None)
    globals()[f"Test{_name.title().replace('_', '')}ElasticMachine"] = _case
del _case, _name


@pytest.mark.parametrize("name", sorted(POOLS))
def test_the_elastic_machines_sleep_and_run_out_under_a_lowered_limit(name):
    """A fixed-seed run sleeps both ways, trims, lowers the limit and runs out of pages
    under it: the elastic rules can fail where it matters."""
    from hypothesis.stateful import run_state_machine_as_test

    key = f"{name} elastic"
    COVERAGE.pop(key, None)
    run_state_machine_as_test(_elastic_class(name), settings=settings(
        max_examples=40, stateful_step_count=30,
        deadline=None, derandomize=True, database=None))  # fmt: skip
    seen = COVERAGE[key]
    assert seen["sleep host"] >= 3 and seen["sleep none"] >= 3, seen
    assert seen["lower"] >= 3 and seen["trim"] >= 3 and seen["pool full"] >= 3, seen
